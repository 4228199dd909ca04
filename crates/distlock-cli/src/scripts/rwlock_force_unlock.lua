-- Deletes a read-write lock whoever holds it (an operator's force-unlock), with its
-- readers' hold keys, and wakes its waiters, readers and writers, on the read-write
-- lock's channel with `1`, the message of a writer's release (docs/layout.md).
--
-- KEYS[1]  the lock's hash: `mode`, a field per reader, `<owner>:write`
-- KEYS[2]  its channel, redisson_rwlock:{<name>}
-- ARGV[1]  the holder the operator was shown (a field of the hash): deleted only while
--          it holds, never a holder that came after
-- ARGV[2]  "publish", or "spublish" on a cluster (where a server without it, before
--          Redis 7, is told with publish)
-- ARGV[3]  `{<name>}`, or the name when it has a hash tag of its own: the start of the
--          readers' hold keys, `<ARGV[3]>:<owner>:rwlock_timeout:<n>`
--
-- Returns 1 when the lock was deleted, 0 when it is gone or ARGV[1] no longer holds it;
-- fails with a NOPERM error, having written nothing, when the user's ACL refuses the
-- publish or the delete (checked first on Redis >= 7.0; before that, the publish comes
-- before the delete, so a refused channel leaves the lock as it was).
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return 0
end
local publish = ARGV[2] == 'spublish' and 'spublish' or 'publish'
-- The readers' hold keys: a reader's field holds its count of holds, one key each.
local holds = {}
local fields = redis.call('hgetall', KEYS[1])
for i = 1, #fields, 2 do
    local field, count = fields[i], tonumber(fields[i + 1])
    if field ~= 'mode' and string.sub(field, -6) ~= ':write' and count then
        for n = 1, math.min(count, 1024) do
            holds[#holds + 1] = ARGV[3] .. ':' .. field .. ':rwlock_timeout:' .. n
        end
    end
end
if redis.acl_check_cmd then
    local allowed = redis.acl_check_cmd(publish, KEYS[2], '1') and redis.acl_check_cmd('del', KEYS[1])
    for i = 1, #holds do
        allowed = allowed and redis.acl_check_cmd('del', holds[i])
    end
    if not allowed then
        return redis.error_reply('NOPERM this user may not publish to ' .. KEYS[2] .. ' and DEL the lock and its read holds')
    end
end
if publish == 'spublish' then
    local told = redis.pcall('spublish', KEYS[2], '1')
    if type(told) == 'table' and told.err then
        redis.call('publish', KEYS[2], '1')
    end
else
    redis.call('publish', KEYS[2], '1')
end
redis.call('del', KEYS[1])
for i = 1, #holds, 1000 do
    redis.call('del', unpack(holds, i, math.min(i + 999, #holds)))
end
return 1

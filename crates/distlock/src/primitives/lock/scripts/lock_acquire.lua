-- Takes a free lease lock for a new owner and hands out a fencing token. Built with
-- ../../shared/fence.lua in front (fence_token).
--
-- KEYS[1]  lock hash: field = owner, value = hold count; the key's PEXPIRE is the lease
-- KEYS[2]  this client's fencing-token counter (never expires, so tokens keep increasing)
-- ARGV[1]  lease, milliseconds
-- ARGV[2]  owner, "<client uuid>:<n>", unique to this attempt
-- ARGV[3]  the lock's counter under the other FencingCounter setting (see fence.lua: read,
--          never written, and not declared in KEYS on purpose)
--
-- Returns one value, so the reply needs no array:
--   >= 1  the owner holds the lock now; the value is its fencing token (an integer, or
--         its decimal text from 2^53 on)
--      0  another owner holds it, with no expiry
--   <= -1 another owner holds it; its lease has (-value - 1) ms left
-- or fails with a NOPERM error, having written nothing, when the user's ACL refuses one
-- of the writes of an acquisition.
--
-- An owner is never reused, so its field exists only if this very attempt already ran (a
-- reply lost, the command sent again): it then holds the lock and gets a fresh token.
-- A free lock costs five calls, a busy one three.
--
-- A refused call aborts a script but keeps what it wrote before, so every write is
-- checked against the user's ACL before the first one (Redis >= 7.0 has acl_check_cmd).
-- On an older server the order does the same job as far as it can: the counter before the
-- lock, and a lock whose lease is refused taken back.
local free = redis.call('exists', KEYS[1]) == 0
if not free and redis.call('hexists', KEYS[1], ARGV[2]) == 0 then
    return -1 - math.max(redis.call('pttl', KEYS[1]), -1)
end
if redis.acl_check_cmd and not (redis.acl_check_cmd('hset', KEYS[1], ARGV[2], '1')
        and redis.acl_check_cmd('pexpire', KEYS[1], ARGV[1])) then
    return redis.error_reply('NOPERM this user may not HSET and PEXPIRE the lock ' .. KEYS[1])
end
local token = fence_token(KEYS[2], ARGV[3])
if type(token) == 'table' then
    return token
end
if free then
    redis.call('hset', KEYS[1], ARGV[2], 1)
end
-- A lock without a lease would never be freed: if the lease is refused (an ACL without
-- PEXPIRE), take the lock back before failing.
local leased = redis.pcall('pexpire', KEYS[1], ARGV[1])
if type(leased) == 'table' and leased.err then
    if free then
        redis.pcall('del', KEYS[1])
    end
    return redis.error_reply(leased.err)
end
return token

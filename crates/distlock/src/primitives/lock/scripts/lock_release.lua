-- Gives back one hold of a holding; the last hold frees the lock and wakes a waiter.
--
-- ../../shared/latch.lua is put in front (latched_answer: a retry's first answer).
--
-- KEYS[1]  lock hash
-- KEYS[2]  release channel (a key, so that on a cluster it is slot-checked with the lock
--          and a sharded publish routes with it)
-- KEYS[3]  unlock latch: caches the answer of a final release, so a retry after a lost
--          reply reads the first answer instead of a false "not held"
-- ARGV[1]  owner
-- ARGV[2]  the owner's hold count after this release (0 = free the lock)
-- ARGV[3]  lease, milliseconds: a partial release re-sets it, as Redisson's does, unless
--          it is "0" (a fixed lease keeps its deadline)
-- ARGV[4]  release message
-- ARGV[5]  how long the latch is kept, milliseconds ("0": write no latch)
-- ARGV[6]  "1" when this is a retry of a request that may have written its latch (only a
--          final release writes one; a partial release has no latch to read)
-- ARGV[7]  "publish", or "spublish" on a Redis 7 cluster (sharded pub/sub, as Redisson's
--          waiters there listen with SSUBSCRIBE)
--
-- Returns the hold count left (0 = the lock is now free), or -1 when the owner does not
-- hold the lock (nothing is written then). Fails with a NOPERM error, having written
-- nothing, when the user's ACL refuses one of the release's writes.
--
-- A partial release sets an absolute count, so repeating it is harmless and needs no
-- latch. The client deletes the latch once it has read the reply.
local latched = latched_answer(KEYS[3], ARGV[6], ARGV[5])
if latched then
    return latched
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return -1
end
if ARGV[2] ~= '0' then
    -- Checked first, as below: a refused PEXPIRE must not leave a new count behind.
    local relet = ARGV[3] ~= '0'
    if redis.acl_check_cmd and not (redis.acl_check_cmd('hset', KEYS[1], ARGV[1], ARGV[2])
            and (not relet or redis.acl_check_cmd('pexpire', KEYS[1], ARGV[3]))) then
        return redis.error_reply('NOPERM this user may not HSET and PEXPIRE the lock ' .. KEYS[1])
    end
    redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
    if relet then
        redis.call('pexpire', KEYS[1], ARGV[3])
    end
    return tonumber(ARGV[2])
end
-- A refused call aborts a script but keeps what it wrote before, so the three writes are
-- checked against the user's ACL first (Redis >= 7.0): refused, the release changes
-- nothing and wakes nobody. On an older server the order limits the damage: the lock is
-- deleted last. Waiters woken by the message run their attempts after this script.
local publish = ARGV[7] == 'spublish' and 'spublish' or 'publish'
if redis.acl_check_cmd then
    if not redis.acl_check_cmd(publish, KEYS[2], ARGV[4]) then
        return redis.error_reply('NOPERM this user may not publish to the release channel ' .. KEYS[2])
    end
    if ARGV[5] ~= '0' and not redis.acl_check_cmd('set', KEYS[3], '0', 'px', ARGV[5]) then
        return redis.error_reply('NOPERM this user may not SET the unlock latch ' .. KEYS[3])
    end
    if not redis.acl_check_cmd('del', KEYS[1]) then
        return redis.error_reply('NOPERM this user may not DEL the lock ' .. KEYS[1])
    end
end
redis.call(publish, KEYS[2], ARGV[4])
if ARGV[5] ~= '0' then
    redis.call('set', KEYS[3], 0, 'px', ARGV[5])
end
redis.call('del', KEYS[1])
return 0

-- Gives back one write hold; the last frees the lock and publishes `1` (Redisson's write
-- unlock, which wakes every waiter), or, when the writer also took read holds (a
-- downgrade), leaves the lock to them in read mode and publishes `1` so that waiting
-- readers join them. Built with rw_common.lua in front.
--
-- ../../shared/latch.lua is put in front (latched_answer: a retry's first answer).
--
-- KEYS[1]  the lock hash
-- KEYS[2]  the channel, redisson_rwlock:{name}
-- KEYS[3]  unlock latch
-- ARGV[1]  the write field, `<owner>:write`
-- ARGV[2]  the write holds after this release
-- ARGV[3]  the lease a partial release sets again ("0": a fixed lease keeps its deadline)
-- ARGV[4]  how long the latch is kept, ms ("0": none)
-- ARGV[5]  "1" on a retry that may find its answer in the latch
-- ARGV[6]  "publish", or "spublish" on a Redis 7 cluster
-- ARGV[7]  `<base>`: `{name}`, or the name when it carries its own hash tag
--
-- Returns the write holds left, or -1 when the owner does not hold the write lock.
local latched = latched_answer(KEYS[3], ARGV[5], ARGV[4])
if latched then
    return latched
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return -1
end
if ARGV[2] ~= '0' then
    redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
    if ARGV[3] ~= '0' then
        redis.call('pexpire', KEYS[1], ARGV[3])
    end
    return tonumber(ARGV[2])
end
redis.call('hdel', KEYS[1], ARGV[1])
if ARGV[4] ~= '0' then
    redis.call('set', KEYS[3], 0, 'px', ARGV[4])
end
local publish = ARGV[6] == 'spublish' and 'spublish' or 'publish'
if redis.call('hlen', KEYS[1]) > 1 then
    -- The writer's own read holds remain (a downgrade): the lock goes to read mode, and
    -- waiting readers are told (Redisson publishes nothing here, and its readers wait out
    -- the lease). Read holds whose leases ran out free it.
    redis.call('hset', KEYS[1], 'mode', 'read')
    if not free_if_abandoned(KEYS[1], ARGV[7], KEYS[2], publish, '1') then
        redis.call(publish, KEYS[2], '1')
    end
    return 0
end
redis.call('del', KEYS[1])
redis.call(publish, KEYS[2], '1')
return 0

-- Gives back one read hold; the last hold of the last reader frees the lock and
-- publishes `0` (Redisson's read unlock). Built with rw_common.lua in front.
--
-- ../../shared/latch.lua is put in front (latched_answer: a retry's first answer).
--
-- KEYS[1]  the lock hash
-- KEYS[2]  the channel, redisson_rwlock:{name}
-- KEYS[3]  unlock latch (answer of a final release, for a retry after a lost reply)
-- ARGV[1]  owner
-- ARGV[2]  the owner's read holds after this release
-- ARGV[3]  the lease a partial release sets again ("0": a fixed lease keeps its deadline)
-- ARGV[4]  how long the latch is kept, ms ("0": none)
-- ARGV[5]  "1" on a retry that may find its answer in the latch
-- ARGV[6]  "publish", or "spublish" on a Redis 7 cluster
-- ARGV[7]  `<base>`: `{name}`, or the name when it carries its own hash tag
--
-- Returns the owner's read holds left, or -1 when it holds none (nothing is written).
local latched = latched_answer(KEYS[3], ARGV[5], ARGV[4])
if latched then
    return latched
end
local holds = tonumber(redis.call('hget', KEYS[1], ARGV[1]))
if not holds then
    return -1
end
local publish = ARGV[6] == 'spublish' and 'spublish' or 'publish'
local prefix = ARGV[7] .. ':' .. ARGV[1] .. ':rwlock_timeout'
if not holds_alive(ARGV[7], ARGV[1], holds) then
    -- A hold's lease ran out: the holding was lost before this release. Its leftovers go,
    -- and a lock nobody alive holds any more is freed.
    for n = 1, holds do
        redis.call('del', hold_key(prefix, n))
    end
    redis.call('hdel', KEYS[1], ARGV[1])
    if redis.call('hlen', KEYS[1]) <= 1 then
        redis.call('del', KEYS[1])
        redis.call(publish, KEYS[2], '0')
    else
        free_if_abandoned(KEYS[1], ARGV[7], KEYS[2], publish, '0')
    end
    return -1
end
local left = tonumber(ARGV[2])
for n = left + 1, holds do
    redis.call('del', hold_key(prefix, n))
end
if left > 0 then
    redis.call('hset', KEYS[1], ARGV[1], left)
    if ARGV[3] ~= '0' then
        for n = 1, left do
            redis.call('pexpire', hold_key(prefix, n), ARGV[3])
        end
    end
    expire_with_readers(KEYS[1], ARGV[7], 0)
    return left
end
redis.call('hdel', KEYS[1], ARGV[1])
if ARGV[4] ~= '0' then
    redis.call('set', KEYS[3], 0, 'px', ARGV[4])
end
if redis.call('hlen', KEYS[1]) > 1 then
    -- Other readers, or the writer that took this read hold (a downgrade), remain; the
    -- lock is freed if the readers left are all ones whose leases ran out.
    free_if_abandoned(KEYS[1], ARGV[7], KEYS[2], publish, '0')
    return 0
end
redis.call('del', KEYS[1])
redis.call(publish, KEYS[2], '0')
return 0

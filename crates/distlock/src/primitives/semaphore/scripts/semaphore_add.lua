-- Adds permits to a semaphore (a release, or `add_permits`), and publishes the new count
-- on its channel, as Redisson's release does: each waiter wakes up to that many waiters.
--
-- ../../shared/latch.lua is put in front (latched_answer: a retry's first answer).
--
-- KEYS[1]  the semaphore: a string holding how many permits are free
-- KEYS[2]  its channel, redisson_sc:{name} (a key, so that on a cluster it is checked
--          with the semaphore's slot and a sharded publish routes with it)
-- KEYS[3]  the request's latch: keeps this call's answer, so that a call sent again after
--          a lost reply reads it instead of adding the permits twice
-- ARGV[1]  how many permits to add (a negative number takes them away)
-- ARGV[2]  "publish", or "spublish" on a Redis 7 cluster
-- ARGV[3]  how long the latch is kept, milliseconds
-- ARGV[4]  "1" when this is the call sent again
--
-- Returns the number of free permits after the change, or fails when the key holds
-- something else than a count.
local latched = latched_answer(KEYS[3], ARGV[4], ARGV[3])
if latched then
    return latched
end
local free = redis.call('get', KEYS[1])
if free ~= false and tonumber(free) == nil then
    return redis.error_reply('ERR ' .. KEYS[1] .. ' does not hold a permit count')
end
local publish = ARGV[2] == 'spublish' and 'spublish' or 'publish'
if redis.acl_check_cmd and not (redis.acl_check_cmd('incrby', KEYS[1], ARGV[1])
        and redis.acl_check_cmd(publish, KEYS[2], '0')
        and redis.acl_check_cmd('set', KEYS[3], '0', 'px', ARGV[3])) then
    return redis.error_reply('NOPERM this user may not INCRBY the semaphore ' .. KEYS[1] .. ', publish on ' .. KEYS[2] .. ' and SET ' .. KEYS[3])
end
local now = redis.call('incrby', KEYS[1], ARGV[1])
redis.call(publish, KEYS[2], now)
redis.call('set', KEYS[3], now, 'px', ARGV[3])
return now

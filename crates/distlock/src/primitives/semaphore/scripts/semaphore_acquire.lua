-- Takes permits from a semaphore, if that many are free (Redisson's RSemaphore layout).
--
-- KEYS[1]  the semaphore: a string holding how many permits are free
-- ARGV[1]  how many permits to take (a positive integer)
--
-- Returns 1 when the permits were taken, 0 when fewer are free (nothing is written), or
-- fails when the key holds something else than a count (it is not a semaphore).
local free = redis.call('get', KEYS[1])
if free == false then
    return 0
end
local count = tonumber(free)
if count == nil or not string.match(free, '^-?%d+$') then
    return redis.error_reply('ERR ' .. KEYS[1] .. ' does not hold a permit count')
end
-- Lua's numbers are doubles, exact only up to 2^53: this comparison settles every ask
-- clearly above or below the count, and lets through one within rounding of it (and
-- then never more than a few thousand above it, so the DECRBY below cannot overflow).
if count < tonumber(ARGV[1]) then
    return 0
end
-- Redis subtracts exactly, in 64 bits: an ask that turns out to exceed the count is put
-- back.
if redis.call('decrby', KEYS[1], ARGV[1]) < 0 then
    redis.call('incrby', KEYS[1], ARGV[1])
    return 0
end
return 1

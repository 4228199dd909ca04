-- Takes every free permit of a semaphore (`drain_permits`).
--
-- KEYS[1]  the semaphore
--
-- Returns how many permits it took, as the decimal text of the count it found (0, a
-- number, when there were none, or no semaphore), or fails
-- when the key holds something else than a count.
local free = redis.call('get', KEYS[1])
if free == false then
    return 0
end
local count = tonumber(free)
if count == nil or not string.match(free, '^-?%d+$') then
    return redis.error_reply('ERR ' .. KEYS[1] .. ' does not hold a permit count')
end
if count <= 0 then
    return 0
end
redis.call('set', KEYS[1], 0)
-- The count as Redis kept it: a Lua number (a double) is not exact above 2^53.
return free

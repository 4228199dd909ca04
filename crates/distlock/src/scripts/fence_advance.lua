-- Raises a fencing-token counter to at least a floor, so that every token handed out
-- afterwards is larger than the floor. For a counter lost with the server's data (a
-- restart without persistence, a failover to a replica that lagged): the resource knows
-- the highest token it accepted, and tokens must start above it again.
--
-- KEYS[1]  fencing-token counter
-- ARGV[1]  floor, a non-negative integer below 2^53 (Lua numbers are doubles)
--
-- Returns the counter's value afterwards: max(its value before, floor). Never lowers it.
local current = tonumber(redis.call('get', KEYS[1]) or '0')
local floor = tonumber(ARGV[1])
if current < floor then
    redis.call('set', KEYS[1], ARGV[1])
    return floor
end
return current

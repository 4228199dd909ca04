-- Takes permits of a permit semaphore, each a lease with its own id. Built with
-- permits.lua in front (reclaim, the ACL check).
--
-- KEYS[1]  free permits: a string holding a count
-- KEYS[2]  timeouts: sorted set, permit id -> ms its lease runs out (`{name}:timeout`)
-- KEYS[3]  the channel, redisson_sc:{name} (shared with a plain semaphore of the name)
-- ARGV[1]  lease, milliseconds
-- ARGV[2]  "publish", or "spublish" on a Redis 7 cluster
-- ARGV[3..] the ids of the permits to take, one per permit
--
-- Returns:
--    1    the permits are taken, each leased until now + lease
--    0    not enough are free, and no taken permit has a lease
--   <= -1 not enough are free; the nearest taken permit's lease runs out in
--         (-value - 1) ms (a waiter looks again then: that permit may come back)
-- or fails with a NOPERM error, having written nothing, when the user's ACL refuses one
-- of its commands.
--
-- Expired permits are reclaimed first, so a holder that died gives its permits back to
-- the next acquisition.
local publish = ARGV[2] == 'spublish' and 'spublish' or 'publish'
local refusal = refused_permit_access(KEYS[1], KEYS[2], KEYS[3], publish)
if refusal then
    return refusal
end
local now = now_ms()
reclaim(KEYS[1], KEYS[2], KEYS[3], publish, now)
local wanted = #ARGV - 2
local free = redis.call('get', KEYS[1])
local count = tonumber(free or '0')
if count == nil then
    return redis.error_reply('ERR ' .. KEYS[1] .. ' does not hold a permit count')
end
if count < wanted then
    local nearest = redis.call('zrange', KEYS[2], 0, 0, 'withscores')
    if nearest[2] then
        return -1 - math.max(tonumber(nearest[2]) - now, 0)
    end
    return 0
end
redis.call('decrby', KEYS[1], wanted)
local until_ms = now + tonumber(ARGV[1])
for i = 3, #ARGV do
    redis.call('zadd', KEYS[2], until_ms, ARGV[i])
end
return 1

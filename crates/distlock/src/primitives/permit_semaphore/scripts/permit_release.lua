-- Gives permits of a permit semaphore back, by id. Built with permits.lua in front.
--
-- KEYS[1]  free permits
-- KEYS[2]  timeouts (sorted set, permit id -> ms)
-- KEYS[3]  the channel, redisson_sc:{name}
-- ARGV[1]  "publish", or "spublish" on a Redis 7 cluster
-- ARGV[2..] the ids of the permits to give back
--
-- Returns how many of them were still taken and are now free (a permit whose lease ran
-- out was reclaimed already, and counts as lost). Publishes the new free count when any
-- came back.
local publish = ARGV[1] == 'spublish' and 'spublish' or 'publish'
local refusal = refused_permit_access(KEYS[1], KEYS[2], KEYS[3], publish)
if refusal then
    return refusal
end
local now = now_ms()
local back = 0
for i = 2, #ARGV do
    local score = redis.call('zscore', KEYS[2], ARGV[i])
    if score and tonumber(score) > now then
        redis.call('zrem', KEYS[2], ARGV[i])
        back = back + 1
    end
end
if back > 0 then
    local free = redis.call('incrby', KEYS[1], back)
    redis.call(publish, KEYS[3], free)
end
reclaim(KEYS[1], KEYS[2], KEYS[3], publish, now)
return back

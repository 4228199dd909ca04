-- Extends the leases of a batch of permits in one call (the renewal scheduler's command
-- for permits).
--
-- KEYS[i]    the timeouts sorted set of the i-th permit's semaphore (on a cluster, a
--            batch holds keys of one slot only)
-- ARGV[1]    lease, milliseconds
-- ARGV[i+1]  the i-th permit's id
--
-- Returns an array with one entry per permit: 1 = renewed, 0 = the permit is no longer
-- taken (its lease ran out, it was reclaimed or given back). A key of the wrong type
-- fails only its own entry.
local time = redis.call('time')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local renewed = {}
for i, key in ipairs(KEYS) do
    local score = nil
    if redis.call('type', key).ok == 'zset' then
        score = tonumber(redis.call('zscore', key, ARGV[i + 1]))
    end
    if score and score > now then
        redis.call('zadd', key, 'XX', now + tonumber(ARGV[1]), ARGV[i + 1])
        renewed[i] = 1
    else
        renewed[i] = 0
    end
end
return renewed

-- Extends the leases of a batch of locks in one call (the watchdog's only command).
--
-- KEYS[i]    lock hash of the i-th lock (on Redis Cluster, a batch must hold keys of one
--            slot only; the standalone watchdog batches any keys together)
-- ARGV[1]    lease, milliseconds
-- ARGV[i+1]  owner expected to hold KEYS[i]
--
-- Returns an array with one entry per key: 1 = renewed, 0 = that owner no longer holds it
-- (the key expired, was deleted, belongs to someone else, or is no longer a hash). A key
-- of the wrong type fails only its own entry, never the batch.
local renewed = {}
for i, key in ipairs(KEYS) do
    if redis.call('type', key).ok == 'hash' and redis.call('hexists', key, ARGV[i + 1]) == 1 then
        redis.call('pexpire', key, ARGV[1])
        renewed[i] = 1
    else
        renewed[i] = 0
    end
end
return renewed

-- Takes or re-enters a reentrant lease lock and hands out a fencing token.
--
-- KEYS[1]  lock hash: field = owner, value = hold count; the key's PEXPIRE is the lease
-- KEYS[2]  fencing-token counter (never expires, so tokens keep increasing across holders)
-- ARGV[1]  lease, milliseconds
-- ARGV[2]  owner, "<client uuid>:<holder id>"
--
-- Returns {1, token, holds} when the caller now holds the lock (holds = its hold count),
--         {0, pttl}         when another owner holds it (pttl = the lease left, ms, or -1
--                           for a key without expiry).
if redis.call('exists', KEYS[1]) == 0 or redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    local holds = redis.call('hincrby', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], ARGV[1])
    local token = redis.call('incr', KEYS[2])
    return {1, token, holds}
end
return {0, redis.call('pttl', KEYS[1])}

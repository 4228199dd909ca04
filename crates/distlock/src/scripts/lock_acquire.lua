-- Takes or re-enters a reentrant lease lock and hands out a fencing token.
--
-- KEYS[1]  lock hash: field = owner, value = hold count; the key's PEXPIRE is the lease
-- KEYS[2]  fencing-token counter (never expires, so tokens keep increasing across holders)
-- ARGV[1]  lease, milliseconds
-- ARGV[2]  owner, "<client uuid>:<holder id>"
-- ARGV[3]  "1" if the client tracks a live holding by this owner (a reentrant acquisition),
--          "0" if not: a hold count the owner still has on the server is then left over
--          from a lost guard or from an acquisition whose reply never arrived, and is reset
--          to 1 instead of counted on
--
-- Returns {1, token, holds} when the caller now holds the lock (holds = its hold count),
--         {0, pttl}         when another owner holds it (pttl = the lease left, ms, or -1
--                           for a key without expiry).
--
-- Every redis.call costs a few microseconds of script overhead, so the common paths make
-- as few as they can: a free lock takes four, a busy one three.
local holds = 1
if redis.call('exists', KEYS[1]) == 0 then
    redis.call('hset', KEYS[1], ARGV[2], 1)
else
    if not redis.call('hget', KEYS[1], ARGV[2]) then
        return {0, redis.call('pttl', KEYS[1])}
    end
    if ARGV[3] == '1' then
        holds = redis.call('hincrby', KEYS[1], ARGV[2], 1)
    else
        redis.call('hset', KEYS[1], ARGV[2], 1)
    end
end
redis.call('pexpire', KEYS[1], ARGV[1])
return {1, redis.call('incr', KEYS[2]), holds}

-- Releases one hold of a reentrant lock; the last hold deletes it and wakes a waiter.
--
-- KEYS[1]  lock hash
-- KEYS[2]  unlock latch: caches this request's answer, so a retry after an ambiguous
--          failure (the reply was lost, not the command) returns the same answer
-- ARGV[1]  owner, "<client uuid>:<holder id>"
-- ARGV[2]  channel to publish the release on
-- ARGV[3]  release message
-- ARGV[4]  how long the latch is kept, milliseconds
-- ARGV[5]  "1" when this is a retry of the same request (only then can the latch hold an
--          answer, so a first attempt does not read it)
--
-- Returns the holds the owner still has (0 = the lock is now free),
--         or -1 when the owner does not hold the lock.
-- While holds remain, the lease is left as it is: the remaining guards set it.
if ARGV[5] == '1' then
    local cached = redis.call('get', KEYS[2])
    if cached then
        return tonumber(cached)
    end
end
local remaining = -1
local holds = redis.call('hget', KEYS[1], ARGV[1])
if holds then
    if tonumber(holds) > 1 then
        remaining = redis.call('hincrby', KEYS[1], ARGV[1], -1)
    else
        remaining = 0
        redis.call('del', KEYS[1])
        redis.call('publish', ARGV[2], ARGV[3])
    end
end
redis.call('set', KEYS[2], remaining, 'px', ARGV[4])
return remaining

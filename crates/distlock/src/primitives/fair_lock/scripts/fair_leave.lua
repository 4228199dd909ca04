-- A waiter gives up on a fair lock (it timed out, was cancelled, or its client shut
-- down): it leaves the queue, and gives the lock back if it was granted to it meanwhile.
-- Built with ../../shared/fence.lua and queue.lua in front.
--
-- KEYS[1]  lock hash
-- KEYS[2]  queue (list)
-- KEYS[3]  timeouts (sorted set)
-- KEYS[4]  distlock's waiters (hash)
-- KEYS[5]  this client's fencing-token counter (handing the lock on takes a token)
-- KEYS[6]  the lock's channel (a waiter's own channel is this, ':' and its owner)
-- ARGV[1]  owner of the acquisition that gave up
-- ARGV[2]  "publish", or "spublish" on a Redis 7 cluster
-- ARGV[3]  the lock's counter under the other FencingCounter setting (see fence.lua)
-- ARGV[4]  Redisson's wait timeout, ms (see fair_acquire.lua)
--
-- Returns 1 when the owner held the lock (a grant it never used) and gave it on, 0 when
-- it only left the queue (or was in neither).
--
-- Redisson's waiters run the same step ("acquire failed") and lower the scores of those
-- behind them; a waiter that skipped it would hold them back until its own score passed.
local publish = ARGV[2] == 'spublish' and 'spublish' or 'publish'
local refusal = refused_queue_access(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6], publish, KEYS[5])
if refusal then
    return refusal
end
local wait = tonumber(ARGV[4])
local held = redis.call('hexists', KEYS[1], ARGV[1]) == 1
local was_head = leave_queue(KEYS[2], KEYS[3], KEYS[4], ARGV[1], wait)
-- This waiter's refreshes may have set the expiry a Redisson waiter behind it must outlive.
local now = now_ms()
keep_for_redissons(KEYS[2], KEYS[3], KEYS[4], now, wait)
if held then
    redis.call('del', KEYS[1])
end
if (held or was_head) and redis.call('exists', KEYS[1]) == 0 then
    -- The next waiter would otherwise wait for its own next look: hand it on now.
    local head, waiter = drop_gone(KEYS[2], KEYS[3], KEYS[4], now)
    hand_to_head(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[3], KEYS[6], publish, wait, now, head, waiter)
end
return held and 1 or 0

-- Gives back one hold of a fair lock; the last hold hands the lock to the head of the
-- queue. Built with ../../shared/fence.lua and queue.lua in front.
--
-- ../../shared/latch.lua is put in front (latched_answer: a retry's first answer).
--
-- KEYS[1]  lock hash
-- KEYS[2]  queue (list)
-- KEYS[3]  timeouts (sorted set)
-- KEYS[4]  distlock's waiters (hash, owner -> "<lease ms>:<alive until ms>")
-- KEYS[5]  this client's fencing-token counter (a direct grant takes a token from it)
-- KEYS[6]  the lock's channel, redisson_lock__channel:{name}; a waiter's own channel is
--          this, ':' and its owner (same slot)
-- KEYS[7]  unlock latch: caches the answer of a final release, so a retry after a lost
--          reply reads the first answer instead of a false "not held"
-- ARGV[1]  owner
-- ARGV[2]  the owner's hold count after this release (0 = give the lock up)
-- ARGV[3]  lease, milliseconds: a partial release re-sets it, unless it is "0" (a fixed
--          lease keeps its deadline)
-- ARGV[4]  how long the latch is kept, milliseconds ("0": write no latch)
-- ARGV[5]  "1" when this is a retry of a request that may have written its latch
-- ARGV[6]  "publish", or "spublish" on a Redis 7 cluster
-- ARGV[7]  the lock's counter under the other FencingCounter setting (see fence.lua)
-- ARGV[8]  Redisson's wait timeout, ms (see fair_acquire.lua)
--
-- Returns the hold count left (0 = given up), or -1 when the owner does not hold the lock
-- (nothing is written then). Fails with a NOPERM error, having written nothing, when the
-- user's ACL refuses one of the commands it runs.
--
-- The final release hands the lock on in the same call (queue.lua's hand_to_head): a
-- distlock waiter at the head holds it, with its token, before this reply is sent.
--
-- Every command that may run after the first write is checked against the ACL before
-- it. The common case (nobody queued, or a live distlock waiter at the head and behind
-- it: see queue.lua's plain_handoff) reads first and checks only its writes and the
-- fencing counter's read; any other case checks every command a fair-lock script may
-- run.
local latched = latched_answer(KEYS[7], ARGV[5], ARGV[4])
if latched then
    return latched
end
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return -1
end
local publish = ARGV[6] == 'spublish' and 'spublish' or 'publish'
if ARGV[2] ~= '0' then
    -- A partial release writes the lock's hash alone, but is refused as any fair-lock
    -- script is (docs/safety.md: a user without the fair lock's rights cannot release).
    local refusal = refused_queue_access(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6], publish, KEYS[5])
    if refusal then
        return refusal
    end
    redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
    if ARGV[3] ~= '0' then
        redis.call('pexpire', KEYS[1], ARGV[3])
    end
    return tonumber(ARGV[2])
end
local now = now_ms()
local plan = plain_handoff(KEYS[2], KEYS[3], KEYS[4], now)
local refusal
if plan then
    refusal = refused_plain_handoff(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6], publish, plan.head, KEYS[5])
else
    refusal = refused_queue_access(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6], publish, KEYS[5])
end
if refusal then
    return refusal
end
if ARGV[4] ~= '0' and redis.acl_check_cmd
        and not redis.acl_check_cmd('set', KEYS[7], '0', 'px', ARGV[4]) then
    return redis.error_reply('NOPERM this user may not SET the unlock latch ' .. KEYS[7])
end
redis.call('del', KEYS[1])
if ARGV[4] ~= '0' then
    redis.call('set', KEYS[7], 0, 'px', ARGV[4])
end
local wait = tonumber(ARGV[8])
if plan then
    hand_to_head(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[7], KEYS[6], publish, wait, now, plan.head, plan.waiter, plan.behind)
else
    local head, waiter = drop_gone(KEYS[2], KEYS[3], KEYS[4], now)
    hand_to_head(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[7], KEYS[6], publish, wait, now, head, waiter)
end
return 0

-- Takes a fair lock in turn, or queues for it. Built with ../../shared/fence.lua and
-- queue.lua in front (fence_token, the queue's functions).
--
-- KEYS[1]  lock hash: field = owner, value = hold count; the key's PEXPIRE is the lease
-- KEYS[2]  queue: list of waiting owners, oldest first (Redisson's redisson_lock_queue)
-- KEYS[3]  timeouts: sorted set, owner -> ms after which it counts as gone
--          (Redisson's redisson_lock_timeout)
-- KEYS[4]  distlock's waiters: hash, owner -> "<lease ms>:<alive until ms>" (takes a
--          direct grant; gone once its alive time passes)
-- KEYS[5]  this client's fencing-token counter
-- KEYS[6]  the lock's channel, redisson_lock__channel:{name}; a waiter's own channel is
--          this, ':' and its owner (same slot)
-- ARGV[1]  lease, milliseconds
-- ARGV[2]  owner, "<client uuid>:<n>": one per acquisition, kept while it waits
-- ARGV[3]  the lock's counter under the other FencingCounter setting (see fence.lua)
-- ARGV[4]  "1": queue (or refresh the queue entry) when the lock cannot be taken now;
--          "0": only try
-- ARGV[5]  how long a queued waiter counts as alive without refreshing, ms
-- ARGV[6]  Redisson's wait timeout, ms: one wait per waiter ahead in a new waiter's
--          score, taken off the scores behind a waiter that leaves
-- ARGV[7]  "publish", or "spublish" on a Redis 7 cluster
--
-- Returns:
--   >= 1       the owner holds the lock now; the value is its fencing token (an integer,
--              or its decimal text from 2^53 on)
--   "busy:<n>" the lock is held, or others are queued ahead; the owner is queued (or its
--              entry refreshed) when ARGV[4] is "1". <n> is the highest token handed out
--              so far (fence.lua's fence_high): a grant message whose token is not above
--              it was made before this call, and is stale.
-- or fails with a NOPERM error, having written nothing, when the user's ACL refuses one
-- of the commands the fair lock runs.
--
-- The lock is taken only when it is free and the owner is at the head of the queue, or
-- nobody is queued: first come, first served. An owner that already holds the lock was
-- granted it directly while this attempt was on its way (or its earlier reply was lost):
-- its lease is set again from now, and it gets a fresh token, so that its holder can
-- count its lease from this call. An owner that was dropped from the queue (it stopped
-- refreshing, or a grant to it ran out) queues again at the back.
--
-- A free lock with someone else at the head (a waiter ahead was just dropped as gone, or
-- the lock's lease ran out, and nothing told the head) gets its head told to try (`0` on
-- its channel), as a Redisson release tells it: without that, a Redisson head waits for
-- its own timer. It is not granted outright, as a release grants a distlock head: a
-- waiter that stopped refreshing still counts as alive for a while, and a grant to a dead
-- one would hold the lock for a whole lease instead of until its alive time passes.
local publish = ARGV[7] == 'spublish' and 'spublish' or 'publish'
local now = now_ms()
local wait = tonumber(ARGV[6])
local alive_ms = tonumber(ARGV[5])
-- The common case of a waiter (queue, or refresh its place, behind a holder) reads first
-- and then writes its own entry only, so only those writes need an ACL check first.
if ARGV[4] == '1' then
    local plan = plain_queueing(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], now, alive_ms)
    if plan then
        local refusal = refused_plain_queueing(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[2], plan.join, KEYS[5])
        if refusal then
            return refusal
        end
        if plan.join then
            join_queue(KEYS[1], KEYS[2], KEYS[3], ARGV[2], wait, now)
        end
        redis.call('hset', KEYS[4], ARGV[2], ARGV[1] .. ':' .. (now + alive_ms))
        return 'busy:' .. fence_high(KEYS[5], ARGV[3])
    end
end
local refusal = refused_queue_access(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6], publish, KEYS[5])
if refusal then
    return refusal
end
local head = drop_gone(KEYS[2], KEYS[3], KEYS[4], now)
local granted = redis.call('hexists', KEYS[1], ARGV[2]) == 1
-- Whether nobody holds the lock (read once; an owner granted it holds it).
local free = not granted and redis.call('exists', KEYS[1]) == 0
if granted or (free and (not head or head == ARGV[2])) then
    local token = fence_token(KEYS[5], ARGV[3])
    if type(token) == 'table' then
        return token
    end
    -- The queue's head once this owner is out of it, when known without a read.
    local next_head = nil
    if head == ARGV[2] then
        -- Taken from the head: as Redisson's acquisition, one wait off every score.
        redis.call('lpop', KEYS[2])
        next_head = shift_deadlines(KEYS[2], KEYS[3], wait, 0)[1] or false
    elseif granted then
        leave_queue(KEYS[2], KEYS[3], KEYS[4], ARGV[2], wait)
    end
    redis.call('zrem', KEYS[3], ARGV[2])
    redis.call('hdel', KEYS[4], ARGV[2])
    if head then
        keep_for_redissons(KEYS[2], KEYS[3], KEYS[4], now, wait, next_head)
    end
    if not granted then
        redis.call('hset', KEYS[1], ARGV[2], 1)
    end
    redis.call('pexpire', KEYS[1], ARGV[1])
    return token
end
if head and free then
    redis.call(publish, KEYS[6] .. ':' .. head, '0')
end
if ARGV[4] == '1' then
    if not redis.call('zscore', KEYS[3], ARGV[2]) then
        join_queue(KEYS[1], KEYS[2], KEYS[3], ARGV[2], wait, now)
    end
    redis.call('hset', KEYS[4], ARGV[2], ARGV[1] .. ':' .. (now + alive_ms))
    expire_queue(KEYS[2], KEYS[3], KEYS[4], now, alive_ms, wait)
end
return 'busy:' .. fence_high(KEYS[5], ARGV[3])

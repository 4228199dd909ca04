-- The fair lock's queue, shared by its scripts. Not a script of its own: it is put in
-- front of each fair-lock script's source when the crate is built (after
-- ../../shared/fence.lua), so these functions are defined before the script's body runs.
--
-- The queue is Redisson's: a list of waiting owners, oldest first, and a sorted set that
-- scores each owner with the absolute time (ms) after which it counts as gone. Scores
-- follow Redisson's rule, for every waiter: a new waiter's score is the score of the
-- waiter ahead of it (or the lock's remaining lease) plus one wait, and each waiter that
-- leaves from ahead takes one wait off the scores behind it. Redisson's scripts apply that
-- rule to distlock's waiters too, so the rule must hold for them.
--
-- distlock's waiters are also in a hash of its own, owner -> "<lease ms>:<alive until ms>":
-- a waiter listed there takes a direct grant (the releasing script gives it the lock, with
-- that lease), and it counts as gone once its alive time passes. It refreshes that time
-- every third of its lease (at most every second), so a killed distlock waiter is dropped
-- within seconds, not after Redisson's wait.

-- The server's clock, in milliseconds.
local function now_ms()
    local time = redis.call('time')
    return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- A token as the text a message carries: exact, never in exponent form.
local function token_text(token)
    if type(token) == 'number' then
        return string.format('%.0f', token)
    end
    return token
end

-- A distlock waiter's entry: its lease and until when it counts as alive; nil for an
-- owner that is not distlock's (or an entry that does not parse).
local function distlock_waiter(waiters, owner)
    local entry = redis.call('hget', waiters, owner)
    if not entry then
        return nil
    end
    local lease, alive = string.match(entry, '^(%d+):(%d+)$')
    if not lease then
        return nil
    end
    return { lease = lease, alive = tonumber(alive) }
end

-- Whether a queued owner counts as gone at `now`: past its score, with no score at all
-- (a list and a set out of step: Redisson's scripts fail comparing nil there), or
-- distlock's, past its alive time. Also returns its distlock entry when it was read (nil
-- for a Redisson waiter, or when the score alone says gone).
local function is_gone(timeouts, waiters, owner, now)
    local deadline = tonumber(redis.call('zscore', timeouts, owner))
    if deadline == nil or deadline <= now then
        return true, nil
    end
    local waiter = distlock_waiter(waiters, owner)
    return waiter ~= nil and waiter.alive <= now, waiter
end

-- Drops the waiters at the head that are gone (is_gone). Returns the head left (false
-- when nobody is queued) and its distlock entry (nil for a Redisson waiter), which the
-- caller would otherwise read again.
local function drop_gone(queue, timeouts, waiters, now)
    while true do
        local head = redis.call('lindex', queue, 0)
        if not head then
            return false, nil
        end
        local gone, waiter = is_gone(timeouts, waiters, head, now)
        if not gone then
            return head, waiter
        end
        redis.call('lpop', queue)
        redis.call('zrem', timeouts, head)
        redis.call('hdel', waiters, head)
    end
end

-- Takes one wait off the scores of the waiters from list index `from` on: one waiter
-- ahead of them has left. Returns those waiters, oldest first. `behind`, when given, is
-- that list as the caller already read it.
local function shift_deadlines(queue, timeouts, wait, from, behind)
    behind = behind or redis.call('lrange', queue, from, -1)
    for _, owner in ipairs(behind) do
        redis.call('zincrby', timeouts, -wait, owner)
    end
    return behind
end

-- Takes `owner` out of the queue wherever it is (Redisson's "acquire failed" step):
-- those behind it move up one wait. Returns whether it was at the head.
local function leave_queue(queue, timeouts, waiters, owner, wait)
    local owners = redis.call('lrange', queue, 0, -1)
    local at = nil
    for i, queued in ipairs(owners) do
        if queued == owner then
            at = i
            break
        end
    end
    if at then
        -- lrange indexes from 0: the first waiter behind it is at index `at`.
        shift_deadlines(queue, timeouts, wait, at)
        redis.call('lrem', queue, 0, owner)
    end
    redis.call('zrem', timeouts, owner)
    redis.call('hdel', waiters, owner)
    return at == 1
end

-- Puts `owner` at the back of the queue, scored as Redisson scores a new waiter.
local function join_queue(lock, queue, timeouts, owner, wait, now)
    local last = redis.call('lindex', queue, -1)
    local ahead
    if last and last ~= owner then
        ahead = (tonumber(redis.call('zscore', timeouts, last)) or now) - now
    else
        ahead = math.max(redis.call('pttl', lock), 0)
    end
    redis.call('lrem', queue, 0, owner)
    redis.call('rpush', queue, owner)
    redis.call('zadd', timeouts, now + ahead + wait, owner)
end

-- Whether a Redisson waiter is queued: an entry scored in the sorted set with none in
-- distlock's hash. Redisson's scripts drop a gone distlock waiter from the list and the
-- set but never from distlock's hash, and each such leftover would hide one Redisson
-- waiter from a count of the two: when the counts alone do not show one, the leftovers
-- are cleared (one ZSCORE per distlock waiter) before counting again.
local function redissons_queued(timeouts, waiters)
    local scored = redis.call('zcard', timeouts)
    local listed = redis.call('hlen', waiters)
    if scored > listed then
        return true
    end
    if scored == 0 then
        return false
    end
    local entries = redis.call('hgetall', waiters)
    for i = 1, #entries, 2 do
        if not redis.call('zscore', timeouts, entries[i]) then
            redis.call('hdel', waiters, entries[i])
            listed = listed - 1
        end
    end
    return scored > listed
end

-- Keeps the queue's keys from expiring, as Redisson keeps them: PERSIST, or, for a user
-- whose ACL predates PERSIST in the documented minimal ACL, the next best thing: the keys
-- last one wait past the last score, which covers every waiter queued so far and one
-- more Redisson waiter behind them.
local function persist_queue(queue, timeouts, waiters, now, wait)
    if redis.call('pttl', queue) == -1 then
        return
    end
    local keys = { queue, timeouts, waiters }
    if not redis.acl_check_cmd or redis.acl_check_cmd('persist', queue) then
        for _, key in ipairs(keys) do
            redis.call('persist', key)
        end
        return
    end
    local last = redis.call('zrange', timeouts, -1, -1, 'withscores')
    local until_ms = math.floor((tonumber(last[2]) or now) - now + wait) + 1000
    for _, key in ipairs(keys) do
        redis.call('pexpire', key, until_ms)
    end
end

-- With a Redisson waiter queued, the queue's keys must not expire: Redisson's scripts never
-- set an expiry and keep a waiter until its score passes, so an expiry a distlock waiter
-- set earlier would take the Redisson waiter's entry with it, and later arrivals would be
-- served first. Run after every change that takes a distlock waiter out of a queue others
-- are still in (it may have been the one whose refreshes set the expiry).
--
-- Nothing needs counting while the head is a distlock waiter still alive, the common case
-- of every handoff: it refreshes its place at least every second, and each refresh that
-- finds the keys' expiry less than half an alive time (plus a second) away counts the
-- Redisson waiters itself (expire_queue) before that expiry can come. The count costs an
-- HGETALL and a ZSCORE per distlock waiter, so skipping it keeps a handoff's cost from
-- growing with the queue.
--
-- `head` is the queue's head when the caller knows it (false: nobody is queued), or nil.
local function keep_for_redissons(queue, timeouts, waiters, now, wait, head)
    if head == nil then
        head = redis.call('lindex', queue, 0)
    end
    if not head then
        return
    end
    local waiter = distlock_waiter(waiters, head)
    if waiter ~= nil and waiter.alive > now then
        return
    end
    if redis.call('pttl', queue) ~= -1 and redissons_queued(timeouts, waiters) then
        persist_queue(queue, timeouts, waiters, now, wait)
    end
end

-- Lets the queue's keys expire once every distlock waiter in them would be gone, so a
-- queue whose waiters all died does not stay behind (the list and the set vanish by
-- themselves when emptied). Keys with more than half an alive time left are left as they
-- are: each waiter refreshes its place three times per alive time, and setting the
-- expiries was most of what a refresh cost. With a Redisson waiter queued the keys are
-- kept instead, as Redisson keeps them; the full count (redissons_queued) runs only when
-- an expiry is about to be set, so a refresh of a queue of distlock's waiters stays cheap.
local function expire_queue(queue, timeouts, waiters, now, alive_ms, wait)
    if redis.call('zcard', timeouts) > redis.call('hlen', waiters) then
        persist_queue(queue, timeouts, waiters, now, wait)
        return
    end
    if redis.call('pttl', waiters) > alive_ms / 2 + 1000 then
        return
    end
    if redissons_queued(timeouts, waiters) then
        persist_queue(queue, timeouts, waiters, now, wait)
        return
    end
    local until_ms = math.floor(alive_ms) + 1000
    redis.call('pexpire', queue, until_ms)
    redis.call('pexpire', timeouts, until_ms)
    redis.call('pexpire', waiters, until_ms)
end

-- Hands the free lock to the head of the queue. A distlock waiter gets it outright: its
-- hold, its lease, a fencing token, and the token published on its own channel, so it
-- holds the lock when the message arrives. A Redisson waiter is told to try (`0` on its
-- channel), as Redisson expects. With nobody queued, `0` goes to the lock's own channel,
-- for waiters of a plain lock of the same name. Returns the owner granted, or false.
--
-- `head` and `waiter` are what drop_gone just answered (the head, false for an empty
-- queue, and its distlock entry); `now` is the time it was given. `behind`, when given,
-- is plain_handoff's list of the waiters behind the head: the next head is then known to
-- be a live distlock waiter, or nobody, and keep_for_redissons has nothing to do.
local function hand_to_head(lock, queue, timeouts, waiters, counter, other, channel, publish, wait, now, head, waiter, behind)
    if not head then
        redis.call(publish, channel, '0')
        return false
    end
    local token = false
    if waiter then
        token = fence_token(counter, other)
        if type(token) == 'table' then
            -- No token to give (a refused or broken counter): the head tries itself and
            -- gets the error there.
            token = false
        end
    end
    if not token then
        redis.call(publish, channel .. ':' .. head, '0')
        return false
    end
    redis.call('hset', lock, head, 1)
    redis.call('pexpire', lock, waiter.lease)
    redis.call('lpop', queue)
    redis.call('zrem', timeouts, head)
    redis.call('hdel', waiters, head)
    if behind then
        shift_deadlines(queue, timeouts, wait, 0, behind)
    else
        behind = shift_deadlines(queue, timeouts, wait, 0)
        keep_for_redissons(queue, timeouts, waiters, now, wait, behind[1] or false)
    end
    redis.call(publish, channel .. ':' .. head, token_text(token))
    return head
end

-- A final release's common case, read before anything is written: nobody is queued, or
-- the head is a distlock waiter that drop_gone would keep and the waiter behind it, if
-- any, is one too, so that keep_for_redissons has nothing to do. Such a release writes
-- only the few keys refused_plain_handoff checks, not everything a fair-lock script may
-- touch. Returns { head = false } for an empty queue, { head, waiter, behind } for a live
-- distlock head (behind: the owners after it, oldest first), or nil for any other case.
local function plain_handoff(queue, timeouts, waiters, now)
    local head = redis.call('lindex', queue, 0)
    if not head then
        return { head = false }
    end
    local gone, waiter = is_gone(timeouts, waiters, head, now)
    if gone or waiter == nil then
        return nil
    end
    local behind = redis.call('lrange', queue, 1, -1)
    if behind[1] == head then
        -- The head listed twice (a list out of step): once the head's entry is gone, the
        -- general path counts the next "head" as a Redisson waiter.
        return nil
    end
    if behind[1] then
        local next_waiter = distlock_waiter(waiters, behind[1])
        if next_waiter == nil or next_waiter.alive <= now then
            return nil
        end
    end
    return { head = head, waiter = waiter, behind = behind }
end

-- The refusal every fair-lock script answers, before its first write, when the user's
-- ACL refuses a command it would run (Redis >= 7.0: a refused call aborts a script but
-- keeps what it wrote before). `allowed` is given redis.acl_check_cmd and answers whether
-- every command the script will run is allowed. An older server has nothing to ask.
-- Returns an error reply, or nil.
local function refused_unless(lock, allowed)
    if redis.acl_check_cmd and not allowed(redis.acl_check_cmd) then
        return redis.error_reply('NOPERM this user may not run the fair lock ' .. lock .. ' (its queue keys, their commands, or its channels)')
    end
    return nil
end

-- An acquisition's common case when it cannot take the lock, read before anything is
-- written: another owner holds it, the head (if any) is another waiter that drop_gone
-- would keep, and queueing this owner (or refreshing its entry) leaves the queue's keys
-- as expire_queue would leave them: no Redisson waiter to persist them for, and an expiry
-- far enough off. Such an attempt writes only its own entry (refused_plain_queueing).
-- Returns { join = whether the owner is not queued yet }, or nil for any other case
-- (fair_acquire.lua's general path).
local function plain_queueing(lock, queue, timeouts, waiters, owner, now, alive_ms)
    local head = redis.call('lindex', queue, 0)
    if head then
        if head == owner or is_gone(timeouts, waiters, head, now) then
            return nil
        end
    end
    if redis.call('exists', lock) == 0 or redis.call('hexists', lock, owner) == 1 then
        return nil
    end
    local join = not redis.call('zscore', timeouts, owner)
    local listed = redis.call('hexists', waiters, owner) == 1
    -- expire_queue's counts as they will be once this owner's entries are written.
    local scored_after = redis.call('zcard', timeouts) + (join and 1 or 0)
    local listed_after = redis.call('hlen', waiters) + (listed and 0 or 1)
    if scored_after > listed_after or redis.call('pttl', waiters) <= alive_ms / 2 + 1000 then
        return nil
    end
    return { join = join }
end

-- refused_queue_access, for an attempt plain_queueing planned: its own entry's writes,
-- and the read of the fencing counter its busy answer makes after them (fence_high).
local function refused_plain_queueing(lock, queue, timeouts, waiters, owner, join, counter)
    return refused_unless(lock, function(check)
        return check('hset', waiters, owner, '1') and check('get', counter)
            and (not join or (check('lrem', queue, '0', owner) and check('rpush', queue, owner)
                and check('zadd', timeouts, '1', owner)))
    end)
end

-- refused_queue_access, for a release plain_handoff planned: the writes of that handoff
-- only (its other reads came first, and a refused read aborts before any write), and the
-- read of the fencing counter that the grant's token makes after them (fence_token
-- checks its own writes).
local function refused_plain_handoff(lock, queue, timeouts, waiters, channel, publish, head, counter)
    return refused_unless(lock, function(check)
        if not head then
            return check('del', lock) and check(publish, channel, '0')
        end
        return check('del', lock) and check(publish, channel .. ':' .. head, '0')
            and check('get', counter)
            and check('hset', lock, head, '1') and check('pexpire', lock, '1')
            and check('lpop', queue) and check('zrem', timeouts, head)
            and check('hdel', waiters, head) and check('zincrby', timeouts, '1', head)
    end)
end

-- Fails, before anything is written, when the user's ACL refuses a command a fair-lock
-- script may run (Redis >= 7.0): a refused call aborts a script but keeps what it wrote
-- before. `channel` is nil for a script that publishes nothing; `counter` is the lock's
-- fencing counter, which a grant or a busy answer reads after the script's first write.
-- Returns an error reply, or nil.
local function refused_queue_access(lock, queue, timeouts, waiters, channel, publish, counter)
    return refused_unless(lock, function(check)
        return check('time')
            and check('exists', lock) and check('hexists', lock, 'o') and check('pttl', lock)
            and check('hset', lock, 'o', '1') and check('pexpire', lock, '1') and check('del', lock)
            and check('lindex', queue, '0') and check('lrange', queue, '0', '-1')
            and check('rpush', queue, 'o') and check('lpop', queue) and check('lrem', queue, '0', 'o')
            and check('pexpire', queue, '1')
            and check('zscore', timeouts, 'o') and check('zrange', timeouts, '0', '-1')
            and check('zcard', timeouts) and check('zadd', timeouts, '1', 'o')
            and check('zincrby', timeouts, '1', 'o') and check('zrem', timeouts, 'o')
            and check('pexpire', timeouts, '1')
            and check('hget', waiters, 'o') and check('hlen', waiters) and check('hgetall', waiters)
            and check('hset', waiters, 'o', '1') and check('hdel', waiters, 'o')
            and check('pexpire', waiters, '1')
            and check('pttl', queue) and check('get', counter)
            and (channel == nil or (check(publish, channel, '0')
                and check(publish, channel .. ':o', '0')))
    end)
end

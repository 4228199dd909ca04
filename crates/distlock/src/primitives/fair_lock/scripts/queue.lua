-- The fair lock's queue, shared by its scripts. Not a script of its own: it is put in
-- front of each fair-lock script's source when the crate is built (after
-- ../../shared/fence.lua), so these functions are defined before the script's body runs.
--
-- The queue is Redisson's: a list of waiting owners, oldest first, and a sorted set that
-- scores each owner with the absolute time (ms, server clock) after which it counts as
-- gone. distlock's waiters are also in a hash of its own, owner -> lease in ms: a waiter
-- listed there takes a direct grant (the releasing script gives it the lock), and its
-- score is how long it stays alive without refreshing its entry, which it does every
-- third of that. A Redisson waiter's score is Redisson's: its expected turn plus
-- Redisson's wait timeout, one wait per waiter ahead of it.

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

-- Drops the waiters at the head that are gone: past their score, or with no score at all
-- (a list and a set out of step: Redisson's scripts fail comparing nil there).
local function drop_gone(queue, timeouts, waiters, now)
    while true do
        local head = redis.call('lindex', queue, 0)
        if not head then
            return
        end
        local deadline = tonumber(redis.call('zscore', timeouts, head))
        if deadline ~= nil and deadline > now then
            return
        end
        redis.call('lpop', queue)
        redis.call('zrem', timeouts, head)
        redis.call('hdel', waiters, head)
    end
end

-- Lowers the scores of Redisson's waiters from list index `from` on by `wait`, as
-- Redisson does when a waiter ahead of them leaves: each of their scores counts one wait
-- per waiter ahead. distlock's waiters keep theirs: they refresh it themselves.
local function shift_redisson_deadlines(queue, timeouts, waiters, wait, from)
    for _, owner in ipairs(redis.call('lrange', queue, from, -1)) do
        if redis.call('hexists', waiters, owner) == 0 then
            redis.call('zincrby', timeouts, -wait, owner)
        end
    end
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
        shift_redisson_deadlines(queue, timeouts, waiters, wait, at)
        redis.call('lrem', queue, 0, owner)
    end
    redis.call('zrem', timeouts, owner)
    redis.call('hdel', waiters, owner)
    return at == 1
end

-- Lets the queue's keys expire once every waiter in them would be gone, so a queue whose
-- waiters all died does not stay behind (the list and the set vanish by themselves when
-- emptied).
local function expire_queue(queue, timeouts, waiters, now, floor)
    local last = redis.call('zrange', timeouts, -1, -1, 'withscores')
    local until_ms = floor
    if last[2] then
        until_ms = math.max(until_ms, tonumber(last[2]) - now)
    end
    until_ms = math.floor(until_ms) + 1000
    redis.call('pexpire', queue, until_ms)
    redis.call('pexpire', timeouts, until_ms)
    redis.call('pexpire', waiters, until_ms)
end

-- Hands the free lock to the head of the queue. A distlock waiter gets it outright: its
-- hold, its lease, a fencing token, and the token published on its own channel, so it
-- holds the lock when the message arrives. A Redisson waiter is told to try (`0` on its
-- channel), as Redisson expects. With nobody queued, `0` goes to the lock's own channel,
-- for waiters of a plain lock of the same name. Returns the owner granted, or false.
local function hand_to_head(lock, queue, timeouts, waiters, counter, other, channel, publish, wait)
    local head = redis.call('lindex', queue, 0)
    if not head then
        redis.call(publish, channel, '0')
        return false
    end
    local lease = redis.call('hget', waiters, head)
    local token = false
    if lease then
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
    redis.call('pexpire', lock, lease)
    redis.call('lpop', queue)
    redis.call('zrem', timeouts, head)
    redis.call('hdel', waiters, head)
    shift_redisson_deadlines(queue, timeouts, waiters, wait, 0)
    redis.call(publish, channel .. ':' .. head, token_text(token))
    return head
end

-- Fails, before anything is written, when the user's ACL refuses a write a fair-lock
-- script may make (Redis >= 7.0): a refused call aborts a script but keeps what it wrote
-- before. `channel` is nil for a script that publishes nothing. Returns an error reply,
-- or nil.
local function refused_queue_writes(lock, queue, timeouts, waiters, channel, publish)
    if not redis.acl_check_cmd then
        return nil
    end
    local allowed = redis.acl_check_cmd('hset', lock, 'o', '1')
        and redis.acl_check_cmd('pexpire', lock, '1')
        and redis.acl_check_cmd('del', lock)
        and redis.acl_check_cmd('rpush', queue, 'o')
        and redis.acl_check_cmd('lpop', queue)
        and redis.acl_check_cmd('lrem', queue, '0', 'o')
        and redis.acl_check_cmd('pexpire', queue, '1')
        and redis.acl_check_cmd('zadd', timeouts, '1', 'o')
        and redis.acl_check_cmd('zincrby', timeouts, '1', 'o')
        and redis.acl_check_cmd('zrem', timeouts, 'o')
        and redis.acl_check_cmd('pexpire', timeouts, '1')
        and redis.acl_check_cmd('hset', waiters, 'o', '1')
        and redis.acl_check_cmd('hdel', waiters, 'o')
        and redis.acl_check_cmd('pexpire', waiters, '1')
        and (channel == nil or (redis.acl_check_cmd(publish, channel, '0')
            and redis.acl_check_cmd(publish, channel .. ':o', '0')))
    if not allowed then
        return redis.error_reply('NOPERM this user may not write the fair lock ' .. lock .. ', its queue keys or its channels')
    end
    return nil
end

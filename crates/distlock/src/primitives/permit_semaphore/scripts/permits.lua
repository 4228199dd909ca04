-- The permit semaphore's shared step: reclaiming expired permits. Not a script of its
-- own: it is put in front of each permit-semaphore script's source when the crate is
-- built, so the functions below are defined before the script's body runs.
--
-- The layout is Redisson's RPermitExpirableSemaphore: a count of free permits at the
-- name, and a sorted set `{name}:timeout` that scores each taken permit's id with the
-- time (ms, server clock) its lease runs out.

-- The server's clock, in milliseconds.
local function now_ms()
    local time = redis.call('time')
    return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- Gives the permits whose lease ran out back to the count, and publishes the new free
-- count if there were any (a holder that died gives its permits back this way).
local function reclaim(count, timeouts, channel, publish, now)
    local expired = redis.call('zrangebyscore', timeouts, '-inf', now)
    if #expired == 0 then
        return
    end
    for _, id in ipairs(expired) do
        redis.call('zrem', timeouts, id)
    end
    local free = redis.call('incrby', count, #expired)
    redis.call(publish, channel, free)
end

-- Fails, before anything is written, when the user's ACL refuses a command these
-- scripts run (Redis >= 7.0). Returns an error reply, or nil.
local function refused_permit_access(count, timeouts, channel, publish)
    if not redis.acl_check_cmd then
        return nil
    end
    local check = redis.acl_check_cmd
    local allowed = check('time') and check('get', count) and check('incrby', count, '1')
        and check('decrby', count, '1')
        and check('zrangebyscore', timeouts, '-inf', '0') and check('zrange', timeouts, '0', '0')
        and check('zadd', timeouts, '1', 'p') and check('zrem', timeouts, 'p')
        and check('zscore', timeouts, 'p')
        and check(publish, channel, '0')
    if not allowed then
        return redis.error_reply('NOPERM this user may not run the permit semaphore ' .. count .. ' (its keys, their commands, or its channel)')
    end
    return nil
end

-- The read-write lock's shared steps. Not a script of its own: it is put in front of each
-- read-write-lock script's source when the crate is built (after ../../shared/fence.lua
-- where a script takes tokens).
--
-- The layout is Redisson's RReadWriteLock: a hash at the name with `mode` ("read" or
-- "write"), a field per reader owner (its hold count) and a field `<owner>:write` for
-- the writer (its hold count). Each read hold n of an owner has a key of its own,
-- `<base>:<owner>:rwlock_timeout:<n>`, whose expiry is that hold's lease (`<base>` is
-- `{name}`, or the name when it carries its own hash tag); the hash expires with the
-- longest of them.

-- The key of read hold `n` of the owner whose holds' keys start with `prefix`.
local function hold_key(prefix, n)
    return prefix .. ':' .. n
end

-- Sets the hash's expiry from its read holds (each reader field's hold keys): in read
-- mode to the longest remaining lease, or `floor` ms if that is longer; in write mode
-- never lower than it is, for the writer's lease governs then. Returns the longest
-- remaining read lease (0 or less: no read hold is alive).
local function expire_with_readers(hash, base, floor)
    local longest = floor
    local fields = redis.call('hgetall', hash)
    for i = 1, #fields, 2 do
        local field, holds = fields[i], tonumber(fields[i + 1])
        if field ~= 'mode' and holds and string.sub(field, -6) ~= ':write' then
            local prefix = base .. ':' .. field .. ':rwlock_timeout'
            for n = 1, holds do
                longest = math.max(longest, redis.call('pttl', hold_key(prefix, n)))
            end
        end
    end
    if redis.call('hget', hash, 'mode') == 'write' then
        longest = math.max(longest, redis.call('pttl', hash))
    end
    if longest > 0 then
        redis.call('pexpire', hash, longest)
    end
    return longest
end

-- Whether every hold key of the owner's `holds` read holds is still there (a hold whose
-- lease ran out is gone).
local function holds_alive(base, owner, holds)
    local prefix = base .. ':' .. owner .. ':rwlock_timeout'
    for n = 1, holds do
        if redis.call('exists', hold_key(prefix, n)) == 0 then
            return false
        end
    end
    return true
end

-- Frees the lock once nobody alive holds it: in read mode with no read hold alive (the
-- fields left are of readers whose leases ran out), DEL and publish `message`. Returns
-- whether it freed it.
local function free_if_abandoned(hash, base, channel, publish, message)
    if redis.call('hget', hash, 'mode') == 'read' and expire_with_readers(hash, base, 0) <= 0 then
        redis.call('del', hash)
        redis.call(publish, channel, message)
        return true
    end
    return false
end

-- The server's clock, in milliseconds.
local function now_ms()
    local time = redis.call('time')
    return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end

-- Drops writers that stopped waiting (their alive time passed) and tells whether one is
-- still waiting: with writer preference, new readers queue behind it.
local function writer_waiting(writers)
    redis.call('zremrangebyscore', writers, '-inf', now_ms())
    return redis.call('zcard', writers) > 0
end

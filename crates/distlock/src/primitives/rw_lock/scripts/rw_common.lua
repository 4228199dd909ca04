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

-- Sets the hash's expiry to the longest remaining lease of its read holds (each reader
-- field's hold keys), or to `floor` ms if that is longer. `base` is `{name}`.
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
    if longest > 0 then
        redis.call('pexpire', hash, longest)
    end
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

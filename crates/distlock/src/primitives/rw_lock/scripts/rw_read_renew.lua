-- Extends the leases of a batch of read holdings in one call (the renewal scheduler's
-- command for read holds), or of one (a fixed lease set by `extend`). Built with
-- rw_common.lua in front.
--
-- KEYS[i]    the lock hash of the i-th holding (on a cluster, a batch holds keys of one
--            slot only)
-- ARGV[1]    lease, milliseconds
-- ARGV[i+1]  the i-th holding, as "<owner>|<base>" (`<base>`: `{name}`, or the name when
--            it carries its own hash tag; an owner never contains `|`)
--
-- Returns an array with one entry per holding: 1 = every one of its hold keys and the
-- hash renewed, 0 = the owner no longer holds a read hold there (or a hold's key ran
-- out). A key of the wrong type
-- fails only its own entry.
local renewed = {}
for i, key in ipairs(KEYS) do
    renewed[i] = 0
    local owner, base = string.match(ARGV[i + 1], '^([^|]*)|(.*)$')
    if owner and redis.call('type', key).ok == 'hash' then
        local holds = tonumber(redis.call('hget', key, owner))
        if holds then
            -- A hold whose key is gone ran out its lease: the holding is lost.
            local prefix = base .. ':' .. owner .. ':rwlock_timeout'
            local all = 1
            for n = 1, holds do
                all = math.min(all, redis.call('pexpire', hold_key(prefix, n), ARGV[1]))
            end
            expire_with_readers(key, base, tonumber(ARGV[1]))
            renewed[i] = all
        end
    end
end
return renewed

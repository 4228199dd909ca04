-- Adds a read hold to an owner's read holding (a re-entry). Built with rw_common.lua in
-- front.
--
-- KEYS[1]  the lock hash
-- ARGV[1]  owner
-- ARGV[2]  the owner's read holds after this re-entry
-- ARGV[3]  lease of the new hold, milliseconds
-- ARGV[4]  `<base>`: `{name}`, or the name when it carries its own hash tag
--
-- Returns 1 when the owner holds read holds (the count is set, the new hold has its key),
-- 0 when it holds none. The count is absolute, so a resend after a lost reply is harmless.
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return 0
end
redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
local prefix = ARGV[4] .. ':' .. ARGV[1] .. ':rwlock_timeout'
redis.call('set', hold_key(prefix, ARGV[2]), 1, 'px', ARGV[3])
expire_with_readers(KEYS[1], ARGV[4], 0)
return 1

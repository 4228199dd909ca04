-- The acquire of a leaner lock layout than Redisson's, measured by the bench only (issue
-- 32: what would a layout for fleets without Redisson give?). The lock is a string holding
-- its owner, set only if absent and with a lease; the fencing token comes from one INCR.
-- Against distlock's own acquire it has no hold count (no re-entry), no ACL pre-checks,
-- and one fencing counter instead of two.
--
-- KEYS[1]  the lock: a string holding the owner, its PEXPIRE the lease
-- KEYS[2]  the lock's fencing counter
-- ARGV[1]  owner
-- ARGV[2]  lease, milliseconds
--
-- Returns the fencing token (>= 1) when the owner took the lock, 0 when it is held.
if redis.call('set', KEYS[1], ARGV[1], 'nx', 'px', ARGV[2]) then
    return redis.call('incr', KEYS[2])
end
return 0

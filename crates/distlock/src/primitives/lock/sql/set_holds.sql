-- Sets a holding's hold count: a partial release, or a re-entry. The count is absolute,
-- so sending it again after a lost reply changes nothing more.
--
-- $1  lock name
-- $2  owner
-- $3  the hold count to set (at least 1)
-- $4  the lease to set again from now, milliseconds (double precision); 0 leaves the
--     expiry as it is (a fixed lease, or a re-entry)
--
-- Returns the row's hold count while the owner holds the lock, no row when it does not.
UPDATE distlock_locks
SET holds = $3,
    expires_at = CASE WHEN $4 > 0 THEN clock_timestamp() + $4 * interval '1 millisecond'
                      ELSE expires_at END
WHERE name = $1 AND owner = $2 AND expires_at > clock_timestamp()
RETURNING holds

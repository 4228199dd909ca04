-- Sets a read holding's hold count (a re-entry, or a partial release). The count is
-- absolute, so sending it again after a lost reply changes nothing more; the lease is
-- left as it is.
--
-- $1  lock name
-- $2  owner
-- $3  the hold count to set (at least 1)
--
-- Returns the count while the owner holds it, no row when it does not.
UPDATE distlock_readers
SET holds = $3
WHERE name = $1 AND owner = $2 AND expires_at > clock_timestamp()
RETURNING holds

-- Ends read holdings whoever holds them, for an operator's force-unlock of the name:
-- every reader, or only one owner's (distlock_read_force_end, schema.sql).
--
-- $1  lock name
-- $2  the owner it must be, or '' for any
-- $3  the lock's notification channel
--
-- Returns one integer: how many read holdings ended.
SELECT distlock_read_force_end($1, $2, $3)

-- Checks, at every connect, that the table and sequence have what the statements use
-- (a table another tool or an older distlock made may not), so that a mismatch is an
-- error at connect rather than at the first release.
--
-- Returns no row; fails (undefined column or table) when something is missing.
SELECT name, owner, holds, token, expires_at, released_by, released_txid,
       (SELECT last_value FROM distlock_tokens)
FROM distlock_locks
LIMIT 0

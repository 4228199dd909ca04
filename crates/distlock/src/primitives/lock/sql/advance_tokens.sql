-- Raises the token sequence to at least a floor, never lowering it. Run in a transaction
-- that first locks distlock_locks in SHARE ROW EXCLUSIVE mode: every acquisition draws
-- its token inside a write to that table, so none draws one between the read and the
-- raise here.
--
-- $1  the floor (bigint, at least 1 below the sequence's maximum)
--
-- Returns the sequence's value afterwards: the highest token handed out or the floor.
SELECT CASE WHEN $1 > handed_out THEN setval('distlock_tokens', $1) ELSE handed_out END
FROM (SELECT CASE WHEN is_called THEN last_value ELSE 0 END AS handed_out
      FROM distlock_tokens) AS counter

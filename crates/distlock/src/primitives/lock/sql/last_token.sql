-- The highest fencing token the sequence has handed out (0 before the first).
--
-- Returns one bigint.
SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM distlock_tokens

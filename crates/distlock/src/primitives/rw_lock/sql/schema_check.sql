-- Checks, at every connect, that the read-write lock's table, column and functions are
-- there, whoever created them.
--
-- Returns no row; fails (undefined column, table or function) when something is missing.
SELECT r.name, r.owner, r.holds, r.expires_at, r.released_by, r.released_txid,
       l.readers_until,
       'distlock_read_release(text,text,text,text)'::regprocedure,
       'distlock_read_renew(double precision,text[],text[])'::regprocedure,
       'distlock_read_extend(text,text,double precision,text)'::regprocedure,
       'distlock_read_force_end(text,text,text)'::regprocedure
FROM distlock_readers AS r, distlock_locks AS l
LIMIT 0

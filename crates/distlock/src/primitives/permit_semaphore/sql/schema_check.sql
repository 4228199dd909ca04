-- Checks, at every connect, that the permit semaphore's tables and functions are there,
-- whoever created them.
--
-- Returns no row; fails (undefined column, table or function) when something is missing.
SELECT s.name, s.permits, p.name, p.owner, p.permits, p.expires_at, p.released_by,
       'distlock_permits_free(text)'::regprocedure,
       'distlock_permit_acquire(text,text,integer,double precision)'::regprocedure,
       'distlock_permit_release(text,text,text,text)'::regprocedure,
       'distlock_permit_renew(double precision,text[],text[])'::regprocedure,
       'distlock_permit_extend(text,text,double precision,text)'::regprocedure,
       'distlock_permit_add(text,bigint,text)'::regprocedure,
       'distlock_permit_set(text,bigint,text)'::regprocedure
FROM distlock_semaphores AS s, distlock_permits AS p
LIMIT 0

-- Takes a read holding for a new owner beside a write holding that still holds (a
-- downgrade), in one statement: no writer can come in between, as the write holding
-- keeps every writer out until the read holding, written before it is released, does.
--
-- $1  lock name
-- $2  the reader's owner, new
-- $3  lease, milliseconds (double precision)
-- $4  the writer's owner
--
-- Returns one row with `true` when the read holding was taken, none when the writer no
-- longer holds the lock.
WITH lease AS (
    SELECT clock_timestamp() + $3 * interval '1 millisecond' AS until
), gate AS (
    UPDATE distlock_locks AS held
    SET readers_until = greatest(held.readers_until, lease.until)
    FROM lease
    WHERE held.name = $1 AND held.owner = $4 AND held.expires_at > clock_timestamp()
    RETURNING held.name
), joined AS (
    INSERT INTO distlock_readers (name, owner, holds, expires_at)
    SELECT gate.name, $2, 1, lease.until FROM gate, lease
    RETURNING owner
)
SELECT true FROM joined

-- Reads a permit semaphore's counts, writing nothing (`total_permits`).
--
-- KEYS[1]  the semaphore's free count
-- KEYS[2]  its `{name}:timeout` set of taken permits
--
-- Returns {free, taken}: `free` the count at KEYS[1] as stored (false when there is
-- none; a string the caller parses otherwise), `taken` the size of KEYS[2]. A permit
-- whose lease ran out is still in KEYS[2] until the next acquisition or release gives it
-- back to the count, so free + taken is the total either way.
return {redis.call('get', KEYS[1]), redis.call('zcard', KEYS[2])}

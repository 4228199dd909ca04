-- Clears the mark of a command that ran under a lock, if the mark is still this holder's:
-- a later holder's mark is left alone.
--
-- KEYS[1]  the mark: distlock_running:{<name>} (see src/run.rs)
-- ARGV[1]  the holder's owner id
--
-- Returns 1 when the mark was this holder's and is gone, 0 otherwise.
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0

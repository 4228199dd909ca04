-- The release of the leaner layout of lean_acquire.lua (bench only): a compare-and-delete
-- that wakes one waiter. Against distlock's own release it writes no unlock latch, so a
-- retry after a lost reply could not tell its own success from a lock it never held.
--
-- KEYS[1]  the lock
-- KEYS[2]  its release channel
-- ARGV[1]  owner
-- ARGV[2]  release message
--
-- Returns 1 when the owner held the lock and freed it, 0 when it did not hold it.
if redis.call('get', KEYS[1]) == ARGV[1] then
    redis.call('del', KEYS[1])
    redis.call('publish', KEYS[2], ARGV[2])
    return 1
end
return 0

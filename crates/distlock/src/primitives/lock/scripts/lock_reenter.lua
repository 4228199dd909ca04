-- Re-enters a holding: sets the owner's hold count, leaving the lease as it is (a re-entry
-- never shortens a holding's lease, and the watchdog or the first lease governs it).
--
-- KEYS[1]  lock hash
-- ARGV[1]  owner
-- ARGV[2]  the owner's hold count after this re-entry
--
-- Returns 1 when the owner holds the lock (the count is set), 0 when it does not.
--
-- The count is absolute, not an increment, so sending it again after a lost reply is
-- harmless, and the next release of the holding corrects a count whose re-entry failed.
if redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return 0
end
redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
return 1

-- Deletes a lock whoever holds it, and wakes a waiter. For operators, not for owners.
--
-- KEYS[1]  lock hash
-- ARGV[1]  channel to publish the release on
-- ARGV[2]  release message
--
-- Returns 1 when a lock was deleted, 0 when there was none.
if redis.call('del', KEYS[1]) == 1 then
    redis.call('publish', ARGV[1], ARGV[2])
    return 1
end
return 0

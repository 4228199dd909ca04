-- Deletes a lock whoever holds it, and wakes a waiter. For operators, not for owners.
--
-- KEYS[1]  lock hash
-- KEYS[2]  release channel
-- ARGV[1]  release message
--
-- Returns 1 when a lock was deleted, 0 when there was none.
--
-- Publishes before deleting, so a user whose ACL refuses the channel leaves the lock as it
-- was (a refused call aborts the script, keeping what it wrote before).
if redis.call('exists', KEYS[1]) == 0 then
    return 0
end
redis.call('publish', KEYS[2], ARGV[1])
redis.call('del', KEYS[1])
return 1

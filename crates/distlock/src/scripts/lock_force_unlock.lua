-- Deletes a lock whoever holds it, and wakes a waiter. For operators, not for owners.
--
-- KEYS[1]  lock hash
-- KEYS[2]  release channel
-- ARGV[1]  release message
--
-- Returns 1 when a lock was deleted, 0 when there was none.
if redis.call('del', KEYS[1]) == 1 then
    redis.call('publish', KEYS[2], ARGV[1])
    return 1
end
return 0

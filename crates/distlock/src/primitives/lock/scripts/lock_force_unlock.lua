-- Deletes a lock whoever holds it, and wakes a waiter. For operators, not for owners.
--
-- KEYS[1]  lock hash
-- KEYS[2]  release channel
-- ARGV[1]  release message
-- ARGV[2]  "publish", or "spublish" on a Redis 7 cluster
-- ARGV[3]  "" to delete whoever holds it; or an owner: delete only while that owner
--          holds it (an operator confirmed deleting that holder's lock, not a later one's)
--
-- Returns 1 when a lock was deleted, 0 when there was none (or ARGV[3]'s owner no longer
-- holds it); fails with a NOPERM error,
-- having written nothing, when the user's ACL refuses the publish or the delete.
--
-- A refused call aborts a script but keeps what it wrote before: both writes are checked
-- against the user's ACL first (Redis >= 7.0), and on older servers the publish comes
-- before the delete, so a refused channel leaves the lock as it was.
local publish = ARGV[2] == 'spublish' and 'spublish' or 'publish'
if redis.call('exists', KEYS[1]) == 0 then
    return 0
end
if ARGV[3] ~= '' and redis.call('hexists', KEYS[1], ARGV[3]) == 0 then
    return 0
end
if redis.acl_check_cmd and not (redis.acl_check_cmd(publish, KEYS[2], ARGV[1])
        and redis.acl_check_cmd('del', KEYS[1])) then
    return redis.error_reply('NOPERM this user may not publish to ' .. KEYS[2] .. ' and DEL the lock')
end
redis.call(publish, KEYS[2], ARGV[1])
redis.call('del', KEYS[1])
return 1

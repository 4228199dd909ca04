-- Sets a semaphore's permits if it has none set yet (`try_set_permits`), and publishes
-- the count, as Redisson's trySetPermits does.
--
-- KEYS[1]  the semaphore
-- KEYS[2]  its channel, redisson_sc:{name}
-- ARGV[1]  the permits (a non-negative integer)
-- ARGV[2]  "publish", or "spublish" on a Redis 7 cluster
--
-- Returns 1 when it was set, 0 when the semaphore already existed (nothing is written).
if redis.call('exists', KEYS[1]) == 1 then
    return 0
end
local publish = ARGV[2] == 'spublish' and 'spublish' or 'publish'
if redis.acl_check_cmd and not (redis.acl_check_cmd('set', KEYS[1], ARGV[1])
        and redis.acl_check_cmd(publish, KEYS[2], ARGV[1])) then
    return redis.error_reply('NOPERM this user may not SET the semaphore ' .. KEYS[1] .. ' and publish on ' .. KEYS[2])
end
redis.call('set', KEYS[1], ARGV[1])
redis.call(publish, KEYS[2], ARGV[1])
return 1

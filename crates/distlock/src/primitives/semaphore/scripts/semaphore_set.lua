-- Sets a semaphore's permits if it has none set yet (`try_set_permits`), and publishes
-- the count, as Redisson's trySetPermits does; otherwise says what count it kept.
--
-- KEYS[1]  the semaphore's free count
-- KEYS[2]  its channel, redisson_sc:{name}
-- KEYS[3]  (a permit semaphore only) its `{name}:timeout` set of taken permits, whose
--          size counts toward the total the caller is told it kept
-- ARGV[1]  the permits (a non-negative integer)
-- ARGV[2]  "publish", or "spublish" on a Redis 7 cluster
--
-- Returns {1, ARGV[1], 0} when it was set; {0, free, taken} when the semaphore already
-- had a count (nothing is written): `free` is the count at KEYS[1] as stored (a string
-- the caller parses; another application's value is reported, not changed), `taken` the
-- size of KEYS[3] (0 without it).
if redis.call('exists', KEYS[1]) == 1 then
    local taken = 0
    if KEYS[3] then
        taken = redis.call('zcard', KEYS[3])
    end
    return {0, redis.call('get', KEYS[1]), taken}
end
local publish = ARGV[2] == 'spublish' and 'spublish' or 'publish'
if redis.acl_check_cmd and not (redis.acl_check_cmd('set', KEYS[1], ARGV[1])
        and redis.acl_check_cmd(publish, KEYS[2], ARGV[1])) then
    return redis.error_reply('NOPERM this user may not SET the semaphore ' .. KEYS[1] .. ' and publish on ' .. KEYS[2])
end
redis.call('set', KEYS[1], ARGV[1])
redis.call(publish, KEYS[2], ARGV[1])
return {1, ARGV[1], 0}

-- Sets a latch's count if it is open (`try_set_count`), and publishes `1` (a new count)
-- on its channel, as Redisson's trySetCount does.
--
-- KEYS[1]  the latch
-- KEYS[2]  its channel, redisson_countdownlatch__channel__{name}
-- ARGV[1]  the count (a positive integer)
-- ARGV[2]  "publish", or "spublish" on a Redis 7 cluster
--
-- Returns 1 when it was set, 0 when the latch already had a count (nothing is written).
if redis.call('exists', KEYS[1]) == 1 then
    return 0
end
local publish = ARGV[2] == 'spublish' and 'spublish' or 'publish'
if redis.acl_check_cmd and not (redis.acl_check_cmd('set', KEYS[1], ARGV[1])
        and redis.acl_check_cmd(publish, KEYS[2], '1')) then
    return redis.error_reply('NOPERM this user may not SET the latch ' .. KEYS[1] .. ' and publish on ' .. KEYS[2])
end
redis.call('set', KEYS[1], ARGV[1])
redis.call(publish, KEYS[2], '1')
return 1

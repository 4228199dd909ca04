-- Counts a latch down by one; at zero it opens: the key goes and `0` is published on its
-- channel, as Redisson's countDown does, waking every waiter.
--
-- KEYS[1]  the latch: a string holding its count
-- KEYS[2]  its channel, redisson_countdownlatch__channel__{name}
-- ARGV[1]  "publish", or "spublish" on a Redis 7 cluster
--
-- Returns the count left (0: open), or fails when the key holds something else than a
-- count. A latch that is already open (no key) stays open: nothing is written.
local count = redis.call('get', KEYS[1])
if count == false then
    return 0
end
if tonumber(count) == nil then
    return redis.error_reply('ERR ' .. KEYS[1] .. ' does not hold a latch count')
end
local publish = ARGV[1] == 'spublish' and 'spublish' or 'publish'
if redis.acl_check_cmd and not (redis.acl_check_cmd('decr', KEYS[1])
        and redis.acl_check_cmd('del', KEYS[1])
        and redis.acl_check_cmd(publish, KEYS[2], '0')) then
    return redis.error_reply('NOPERM this user may not DECR and DEL the latch ' .. KEYS[1] .. ' and publish on ' .. KEYS[2])
end
local left = redis.call('decr', KEYS[1])
if left <= 0 then
    redis.call('del', KEYS[1])
    redis.call(publish, KEYS[2], '0')
    return 0
end
return left

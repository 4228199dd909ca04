-- Takes the write hold of a read-write lock, with a fencing token. Built with
-- ../../shared/fence.lua and rw_common.lua in front.
--
-- KEYS[1]  the lock hash
-- KEYS[2]  this client's fencing-token counter
-- KEYS[3]  the writers waiting (sorted set, owner -> alive until, ms)
-- ARGV[1]  lease, milliseconds
-- ARGV[2]  owner
-- ARGV[3]  the lock's counter under the other FencingCounter setting (see fence.lua)
-- ARGV[4]  how long this writer counts as waiting without another attempt, ms ("0":
--          it does not wait)
-- ARGV[5]  the writer's id in the writers waiting: one per acquisition (an attempt's
--          owner is new each time)
--
-- Returns the fencing token (>= 1) when the owner holds the write lock now, or
-- (-1 - PTTL) when it is held (0: held with no expiry); a writer that will wait is
-- then listed as waiting, so that readers with writer preference queue behind it.
local mode = redis.call('hget', KEYS[1], 'mode')
local mine = redis.call('hexists', KEYS[1], ARGV[2] .. ':write') == 1
-- A hash with no mode is a plain lock of the same name: held.
local free = mode == false and redis.call('exists', KEYS[1]) == 0
if free or (mode == 'write' and mine) then
    local token = fence_token(KEYS[2], ARGV[3])
    if type(token) == 'table' then
        return token
    end
    if not mine then
        redis.call('hset', KEYS[1], 'mode', 'write', ARGV[2] .. ':write', 1)
    end
    redis.call('pexpire', KEYS[1], ARGV[1])
    redis.call('zrem', KEYS[3], ARGV[5])
    return token
end
if ARGV[4] ~= '0' then
    local alive = now_ms() + tonumber(ARGV[4])
    redis.call('zadd', KEYS[3], alive, ARGV[5])
    redis.call('pexpire', KEYS[3], tonumber(ARGV[4]) + 1000)
end
return -1 - math.max(redis.call('pttl', KEYS[1]), -1)

-- Takes a read hold of a read-write lock. Built with rw_common.lua in front.
--
-- KEYS[1]  the lock hash (`mode`, reader fields, `<owner>:write`)
-- KEYS[2]  the writers waiting (sorted set, owner -> alive until, ms): distlock's, for
--          writer preference
-- ARGV[1]  lease, milliseconds
-- ARGV[2]  owner
-- ARGV[3]  the prefix of the owner's hold keys, `<base>:<owner>:rwlock_timeout`
-- ARGV[4]  "1": writer preference (no new reader while a writer waits)
-- ARGV[5]  "1": a downgrade, which only the owner's own write hold may make
--
-- Returns 1 when the owner holds a read hold now (hold 1, or the next one of a writer
-- taking a read hold: a downgrade), 0 when a writer that waits comes first or the lock
-- is held with no expiry, -2 for a downgrade whose write hold is gone, or (-1 - PTTL)
-- when the lock is held for writing by another owner, or by a plain lock.
local mode = redis.call('hget', KEYS[1], 'mode')
local downgrade = mode == 'write' and redis.call('hexists', KEYS[1], ARGV[2] .. ':write') == 1
if ARGV[5] == '1' and not downgrade then
    -- The write hold to downgrade is gone: nothing is taken.
    return -2
end
if (mode == 'write' and not downgrade)
        or (mode == false and redis.call('exists', KEYS[1]) == 1) then
    -- Another writer, or a plain lock of the same name (a hash with no mode).
    return -1 - math.max(redis.call('pttl', KEYS[1]), -1)
end
if not downgrade and ARGV[4] == '1' and writer_waiting(KEYS[2]) then
    return 0
end
if mode == false then
    redis.call('hset', KEYS[1], 'mode', 'read')
end
local holds = redis.call('hincrby', KEYS[1], ARGV[2], 1)
redis.call('set', hold_key(ARGV[3], holds), 1, 'px', ARGV[1])
local left = redis.call('pttl', KEYS[1])
redis.call('pexpire', KEYS[1], math.max(left, tonumber(ARGV[1])))
return 1

-- Writes (or keeps) one holder's record in the holders' hash beside a lock, and makes
-- the hash live at least as long as this holder's lease: never shorter, since other
-- holders (of a semaphore, or readers) may have longer ones.
--
-- KEYS[1]  the holders' hash: distlock_holders:{<name>} (see src/holder.rs)
-- ARGV[1]  the holder's owner id
-- ARGV[2]  the record (JSON), or '' to keep the one there
-- ARGV[3]  milliseconds the hash must live at least
--
-- Returns 1, or 0 when there was no record to keep.
if ARGV[2] ~= '' then
    redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
elseif redis.call('hexists', KEYS[1], ARGV[1]) == 0 then
    return 0
end
local ttl = tonumber(ARGV[3])
if redis.call('pttl', KEYS[1]) < ttl then
    redis.call('pexpire', KEYS[1], ttl)
end
return 1

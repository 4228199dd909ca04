-- Claims, or keeps, the mark of a command that runs under a lock: set only when the mark
-- is absent or already this holder's, so two holders never both believe they marked it
-- (one that lost the lock while it waited, and the next).
--
-- KEYS[1]  the mark (see src/mark.rs)
-- ARGV[1]  the holder's owner id
-- ARGV[2]  how long the mark lives, milliseconds
--
-- Returns 0 when the mark is this holder's now (set, with that expiry), or the
-- milliseconds another holder's mark has left (at least 1).
local marked = redis.call('get', KEYS[1])
if marked and marked ~= ARGV[1] then
    return math.max(redis.call('pttl', KEYS[1]), 1)
end
redis.call('set', KEYS[1], ARGV[1], 'px', ARGV[2])
return 0

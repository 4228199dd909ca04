-- Whether the count at KEYS[1] is a semaphore distlock created for the name ARGV[1].
--
-- KEYS[1]  the semaphore's count: the name's key
-- KEYS[2]  its mark, {<name>}:distlock_semaphore (<name>:distlock_semaphore for a name
--          with a hash tag): a string holding the name whose `run -n` created it. The
--          names `q` and `{q}` have one mark key (as they have one set of permits,
--          {q}:timeout), so the mark says which of them it is for.
-- ARGV[1]  the name
--
-- Returns 1 when it is ARGV[1]'s semaphore (its mark names ARGV[1]), or when there is
-- no count and no mark yet (the mark is set now, before the count, so a count distlock
-- makes always has its mark); 0 for a count without ARGV[1]'s mark (another
-- application's number, or a semaphore another program made); 2 when there is no count
-- but the mark is another name's (`q`'s mark, asked for `{q}`).
local mark = redis.call('get', KEYS[2])
if mark == ARGV[1] then
    return 1
end
if redis.call('exists', KEYS[1]) == 1 then
    return 0
end
if mark then
    return 2
end
redis.call('set', KEYS[2], ARGV[1])
return 1

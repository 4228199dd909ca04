-- Whether the count at KEYS[1] is a semaphore distlock created: 1 when it is (its mark
-- KEYS[2] is there), or when there is no count yet (the mark is set now, before the
-- count, so a count distlock makes always has its mark); 0 for a count without a mark
-- (another application's number, or a semaphore another program made).
if redis.call('exists', KEYS[2]) == 1 then
    return 1
end
if redis.call('exists', KEYS[1]) == 0 then
    redis.call('set', KEYS[2], ARGV[1])
    return 1
end
return 0

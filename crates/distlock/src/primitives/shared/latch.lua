-- The unlock-latch step every script that gives something back shares. Not a script of
-- its own: it is put in front of each such script's source when the crate is built.
--
-- latched_answer(latch, retry, kept) -> the answer a first attempt of this request left
-- in its latch, when this is a retry (`retry` is "1") of a request that keeps one (`kept`
-- is not "0"); nil otherwise, and the script goes on. A retry after a lost reply then
-- reads the first answer instead of giving back twice or answering a false "not held".
local function latched_answer(latch, retry, kept)
    if retry ~= '1' or kept == '0' then
        return nil
    end
    local cached = redis.call('get', latch)
    if cached then
        return tonumber(cached)
    end
    return nil
end

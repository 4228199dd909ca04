-- The fencing-token step every script that grants a lock shares. It is not a script of
-- its own: it is put in front of each granting script's source when the crate is built
-- (see the primitive's scripts.rs), so the function below is defined before the script's
-- body runs.
--
-- fence_token(counter, other) -> token, or an error reply (a table with `err`)
--   counter  the lock's fencing-token counter in this client's FencingCounter setting: a
--            declared key of the script, never expired, so tokens keep increasing
--   other    the lock's counter under the other FencingCounter setting, a key in the
--            lock's slot: read, never written (a fleet whose clients count differently
--            must not repeat a token). Scripts pass it in ARGV, not KEYS, on purpose: it
--            usually does not exist, and while a Cluster slot migrates Redis refuses (ASK,
--            TRYAGAIN) a script whose declared keys are not all present.
--
-- The token is one more than the larger of the two counters, so tokens strictly increase
-- across every client of the lock, whichever counter each uses. It is an integer, or the
-- counter's decimal text once tokens reach 2^53, where a Lua number, which is a double,
-- can no longer hold every integer.
--
-- A user whose ACL may not read the other counter skips that comparison (docs/safety.md
-- lists the rights). An other counter that is not a positive integer below 2^63 - 1 is
-- ignored; an own counter that is not a positive integer is replaced by a usable other
-- counter, or else refused (an error) before anything is written. An own counter at
-- 2^63 - 1 has no token left: INCR fails, and it is never lowered.
--
-- Every write here is checked against the user's ACL before the first one (Redis >= 7.0
-- has acl_check_cmd), so a caller that checks its own writes first and calls this before
-- writing keeps the rule that a refused script writes nothing.
local function fence_token(counter, other)
    local read_other = true
    if redis.acl_check_cmd then
        if not redis.acl_check_cmd('incr', counter) then
            return redis.error_reply('NOPERM this user may not INCR the fencing counter ' .. counter)
        end
        read_other = redis.acl_check_cmd('get', other)
    end
    -- Counters are compared as text: a double cannot tell two counters apart above 2^53.
    -- A counter holds a canonical positive integer up to 2^63 - 1; the other one is a
    -- token source only below that, so that one more token fits. Anything else written
    -- there is never copied, and never spreads.
    local I64_MAX = '9223372036854775807'
    local function canonical(value)
        return type(value) == 'string' and string.match(value, '^[1-9]%d*$') ~= nil
            and (#value < #I64_MAX or (#value == #I64_MAX and value <= I64_MAX))
    end
    local function above(a, b)
        return #a > #b or (#a == #b and a > b)
    end
    local mine = redis.call('get', counter)
    local mine_ok = mine == false or mine == '0' or canonical(mine)
    if read_other then
        local theirs = redis.call('get', other)
        if theirs == I64_MAX then
            -- The other setting handed out the last token there is: none can be above it.
            return redis.error_reply('ERR the fencing counter ' .. other .. ' has handed out its last token')
        end
        if canonical(theirs) and (mine == false or not mine_ok or above(theirs, mine)) then
            if redis.acl_check_cmd and not redis.acl_check_cmd('set', counter, theirs) then
                return redis.error_reply('NOPERM this user may not SET the fencing counter ' .. counter)
            end
            redis.call('set', counter, theirs)
            mine_ok = true
        end
    end
    if not mine_ok then
        -- Something else wrote the counter (negative, not a number): nothing is written,
        -- and tokens go on only once an operator raises it.
        return redis.error_reply('ERR the fencing counter ' .. counter .. ' is not a positive integer; raise it with advance_fencing_counter')
    end
    local token = redis.call('incr', counter)
    if token >= 9007199254740992 then
        -- A double rounds above 2^53; the counter's own text is exact.
        token = redis.call('get', counter)
    end
    return token
end

-- fence_high(counter, other) -> the larger of the two counters, as decimal text ("0" when
-- neither holds a token yet): every token handed out so far is at most this. A waiter
-- told it can tell a grant made before from one made after (a grant's token is above it).
local function fence_high(counter, other)
    local high = '0'
    local function consider(value)
        if type(value) == 'string' and string.match(value, '^[1-9]%d*$')
                and (#value > #high or (#value == #high and value > high)) then
            high = value
        end
    end
    consider(redis.call('get', counter))
    if not redis.acl_check_cmd or redis.acl_check_cmd('get', other) then
        consider(redis.call('get', other))
    end
    return high
end

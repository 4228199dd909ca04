-- Takes a free lease lock for a new owner and hands out a fencing token.
--
-- KEYS[1]  lock hash: field = owner, value = hold count; the key's PEXPIRE is the lease
-- KEYS[2]  this client's fencing-token counter (never expires, so tokens keep increasing)
-- ARGV[1]  lease, milliseconds
-- ARGV[2]  owner, "<client uuid>:<n>", unique to this attempt
-- ARGV[3]  the lock's counter under the other FencingCounter setting, a key in the lock's
--          slot: read, never written (a fleet whose clients count differently must not
--          repeat a token). It is not declared in KEYS on purpose: it usually does not
--          exist, and while a Cluster slot migrates Redis refuses (ASK, TRYAGAIN) a script
--          whose declared keys are not all present, so declaring it would fail every
--          acquisition of the slot until the migration ends.
--
-- Returns one value, so the reply needs no array:
--   >= 1  the owner holds the lock now; the value is its fencing token (an integer, or
--         the counter's decimal text once tokens reach 2^53, where a Lua number, which is
--         a double, can no longer hold every integer)
--      0  another owner holds it, with no expiry
--   <= -1 another owner holds it; its lease has (-value - 1) ms left
-- or fails with a NOPERM error, having written nothing, when the user's ACL refuses one
-- of the writes of an acquisition.
--
-- An owner is never reused, so its field exists only if this very attempt already ran (a
-- reply lost, the command sent again): it then holds the lock and gets a fresh token.
-- A free lock costs five calls, a busy one three.
--
-- A token is one more than the larger of the two counters, so tokens strictly increase
-- across every client of the lock, whichever counter each uses. A user whose ACL may not
-- read the other counter skips that comparison (docs/safety.md lists the rights). An
-- other counter that is not a positive integer below 2^63 - 1 is ignored; an own counter
-- that is not a positive integer is replaced by a usable other counter, or else refused
-- (an error) before anything is written. An own counter at 2^63 - 1 has no token left:
-- INCR fails, and it is never lowered.
--
-- A refused call aborts a script but keeps what it wrote before, so every write is
-- checked against the user's ACL before the first one (Redis >= 7.0 has acl_check_cmd).
-- On an older server the order does the same job as far as it can: the counter before the
-- lock, and a lock whose lease is refused taken back.
local free = redis.call('exists', KEYS[1]) == 0
if not free and redis.call('hexists', KEYS[1], ARGV[2]) == 0 then
    return -1 - math.max(redis.call('pttl', KEYS[1]), -1)
end
local read_other = true
if redis.acl_check_cmd then
    if not redis.acl_check_cmd('incr', KEYS[2]) then
        return redis.error_reply('NOPERM this user may not INCR the fencing counter ' .. KEYS[2])
    end
    if not (redis.acl_check_cmd('hset', KEYS[1], ARGV[2], '1')
            and redis.acl_check_cmd('pexpire', KEYS[1], ARGV[1])) then
        return redis.error_reply('NOPERM this user may not HSET and PEXPIRE the lock ' .. KEYS[1])
    end
    read_other = redis.acl_check_cmd('get', ARGV[3])
end
-- Counters are compared as text: a double cannot tell two counters apart above 2^53.
-- A counter holds a canonical positive integer up to 2^63 - 1; the other one is a token
-- source only below that, so that one more token fits. Anything else written there is
-- never copied, and never spreads.
local I64_MAX = '9223372036854775807'
local function canonical(counter)
    return type(counter) == 'string' and string.match(counter, '^[1-9]%d*$') ~= nil
        and (#counter < #I64_MAX or (#counter == #I64_MAX and counter <= I64_MAX))
end
local function above(a, b)
    return #a > #b or (#a == #b and a > b)
end
local mine = redis.call('get', KEYS[2])
local mine_ok = mine == false or mine == '0' or canonical(mine)
if read_other then
    local other = redis.call('get', ARGV[3])
    if other == I64_MAX then
        -- The other setting handed out the last token there is: none can be above it.
        return redis.error_reply('ERR the fencing counter ' .. ARGV[3] .. ' has handed out its last token')
    end
    if canonical(other) and (mine == false or not mine_ok or above(other, mine)) then
        if redis.acl_check_cmd and not redis.acl_check_cmd('set', KEYS[2], other) then
            return redis.error_reply('NOPERM this user may not SET the fencing counter ' .. KEYS[2])
        end
        redis.call('set', KEYS[2], other)
        mine_ok = true
    end
end
if not mine_ok then
    -- Something else wrote the counter (negative, not a number): nothing is written, and
    -- tokens go on only once an operator raises it.
    return redis.error_reply('ERR the fencing counter ' .. KEYS[2] .. ' is not a positive integer; raise it with advance_fencing_counter')
end
local token = redis.call('incr', KEYS[2])
if token >= 9007199254740992 then
    -- A double rounds above 2^53; the counter's own text is exact.
    token = redis.call('get', KEYS[2])
end
if free then
    redis.call('hset', KEYS[1], ARGV[2], 1)
end
-- A lock without a lease would never be freed: if the lease is refused (an ACL without
-- PEXPIRE), take the lock back before failing.
local leased = redis.pcall('pexpire', KEYS[1], ARGV[1])
if type(leased) == 'table' and leased.err then
    if free then
        redis.pcall('del', KEYS[1])
    end
    return redis.error_reply(leased.err)
end
return token

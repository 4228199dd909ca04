-- Raises a fencing-token counter to at least a floor, so that every token handed out
-- afterwards is larger than the floor. For a counter lost with the server's data (a
-- restart without persistence, a failover to a replica that lagged): the resource knows
-- the highest token it accepted, and tokens must start above it again.
--
-- KEYS[1]  fencing-token counter
-- ARGV[1]  floor: a canonical decimal integer, 0 <= floor < 2^63 - 1 (checked by the
--          client), compared as text so that it stays exact above 2^53
--
-- Returns the counter's value afterwards, as decimal text: max(its value before, floor).
-- Never lowers a valid counter.
local current = redis.call('get', KEYS[1]) or '0'
local floor = ARGV[1]
-- A counter that is not a canonical non-negative integer a token can come from (something
-- else wrote it: not a number, negative, or above 2^63 - 1, where INCR fails) is
-- replaced: this is the operator's recovery call. One at 2^63 - 1 is kept: it handed out
-- the last token there is, and lowering it would repeat tokens.
local I64_MAX = '9223372036854775807'
local canonical = current == '0' or (string.match(current, '^[1-9]%d*$') ~= nil
    and (#current < #I64_MAX or (#current == #I64_MAX and current <= I64_MAX)))
if not canonical or #floor > #current or (#floor == #current and floor > current) then
    redis.call('set', KEYS[1], floor)
    return floor
end
return current

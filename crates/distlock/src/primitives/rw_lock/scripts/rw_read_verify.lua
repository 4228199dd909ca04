-- Whether an owner still holds its read holds: its field, and every hold's own key (a
-- hold whose lease ran out is gone). Built with rw_common.lua in front.
--
-- KEYS[1]  the lock hash
-- ARGV[1]  owner
-- ARGV[2]  `<base>`: `{name}`, or the name when it carries its own hash tag
--
-- Returns 1 when every one of its holds is there, 0 when not.
local holds = tonumber(redis.call('hget', KEYS[1], ARGV[1]))
if not holds or not holds_alive(ARGV[2], ARGV[1], holds) then
    return 0
end
return 1

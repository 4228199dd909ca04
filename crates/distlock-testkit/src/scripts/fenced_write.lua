-- fenced_write.lua: accept a write only from the newest lock holder.
--
-- KEYS[1]  data key: receives ARGV[2] when the write is accepted (string)
-- KEYS[2]  fence key: highest fencing token accepted so far (decimal string)
-- KEYS[3]  rejected key: number of writes refused so far (integer counter)
--
-- ARGV[1]  fencing token of the writer (decimal, no leading zeros)
-- ARGV[2]  value to write
--
-- Returns 1 when the write is accepted: no token seen yet, or ARGV[1] is
--           greater than or equal to the highest token seen (equal lets the
--           current holder write repeatedly). The fence key is raised to
--           ARGV[1] and the value is stored.
--         0 when the write is refused because a newer holder has written;
--           the rejected counter is incremented and nothing else changes.
-- Errors  when ARGV[1] is not a canonical decimal integer.

local token = ARGV[1]
if not string.match(token, '^%d+$') or (#token > 1 and string.sub(token, 1, 1) == '0') then
  return redis.error_reply('ERR fenced_write: token must be a decimal integer without leading zeros')
end

-- Tokens are u64 but Lua numbers are doubles (exact only up to 2^53), so
-- compare the canonical decimal strings instead: a longer string is a larger
-- number, and equal-length strings compare digit by digit. Bytes are compared
-- explicitly because Lua's string `<` goes through strcoll (locale-dependent).
local function at_least(a, b)
  if #a ~= #b then
    return #a > #b
  end
  for i = 1, #a do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x > y
    end
  end
  return true
end

local highest = redis.call('GET', KEYS[2])
if highest and not at_least(token, highest) then
  redis.call('INCR', KEYS[3])
  return 0
end

redis.call('SET', KEYS[2], token)
redis.call('SET', KEYS[1], ARGV[2])
return 1

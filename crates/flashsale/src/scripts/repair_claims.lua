-- repair_claims.lua: removes segmented claims whose sale can no longer happen. A claim's
-- settle-by time is past its purchase's deadline plus the write fence and the clock
-- grace: by then the sale's write either landed (and replaced the claim with the order id)
-- or can never land. So a claim still there after it was left by a crash, and only blocks
-- its user.
--
-- KEYS[1]  buyers hash  (user id -> order id, or a claim "~SETTLE_BY:INSTANCE:ORDER")
-- KEYS[2]  claims sorted set  (user id, scored by settle-by time)
-- ARGV[1]  most claims to look at in this call
--
-- Returns  the number of stale claims removed
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local removed = 0
for _, user in ipairs(due) do
  local entry = redis.call('HGET', KEYS[1], user)
  local settle_by = entry and tonumber(string.match(entry, '^~(%d+):'))
  if settle_by and settle_by <= now then
    redis.call('HDEL', KEYS[1], user)
    removed = removed + 1
  end
  -- A sale (an order id), no entry, or a newer claim with a later time: either way this
  -- member's time has passed. A newer claim re-added its member with its own time.
  if not (settle_by and settle_by > now) then
    redis.call('ZREM', KEYS[2], user)
  end
end
return removed

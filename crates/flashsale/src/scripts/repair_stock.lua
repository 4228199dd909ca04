-- repair_stock.lua: gives Redis the buyers SQL holds that it does not know, and lowers the
-- coupon's units left to what its known buyers leave.
--
-- A Redis whose counters are behind SQL (restored from a backup, copied with a data
-- directory, or one that lost the lock strategy's update after a commit) still holds a
-- "live" counter, so no reload happens; it would sell again units SQL already sold. Every
-- buyer with an order id in the hash holds a unit, so the units left can never exceed the
-- stock minus those buyers: lowering the counter to that bound never takes away a unit
-- that is for sale. Claims in progress (`~…`, listed in the claims set) hold no unit yet;
-- a claim on a buyer SQL holds an order for is settled (a backup taken mid-sale keeps the
-- claim of a sale that completed), so it is replaced by the order.
--
-- KEYS[1]  stock hash: segment -> units left
-- KEYS[2]  buyers hash: user id -> order id (or a segmented claim "~…")
-- KEYS[3]  claims sorted set: user ids with a claim in progress
-- ARGV[1]  the coupon's stock
-- ARGV[2…] pairs of user id, order id: orders stored in SQL (a page of them)
--
-- Returns  {buyers added, units the counter was lowered by}; {0, 0} when the coupon is not
--          loaded (the loader rebuilds it from SQL).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0, 0}
end
local added = 0
for i = 2, #ARGV - 1, 2 do
  local held = redis.call('HGET', KEYS[2], ARGV[i])
  if not held or string.sub(held, 1, 1) == '~' then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    redis.call('ZREM', KEYS[3], ARGV[i])
    added = added + 1
  end
end
local holding = redis.call('HLEN', KEYS[2]) - redis.call('ZCARD', KEYS[3])
local bound = math.max(tonumber(ARGV[1]) - holding, 0)
local shares = redis.call('HGETALL', KEYS[1])
local left = 0
for i = 2, #shares, 2 do
  left = left + tonumber(shares[i])
end
local excess = left - bound
local lowered = 0
for i = 1, #shares - 1, 2 do
  if excess <= 0 then
    break
  end
  local take = math.min(tonumber(shares[i + 1]), excess)
  if take > 0 then
    redis.call('HINCRBY', KEYS[1], shares[i], -take)
    excess = excess - take
    lowered = lowered + take
  end
end
return {added, lowered}

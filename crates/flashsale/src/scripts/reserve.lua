-- reserve.lua: purchases of one coupon by a batch of buyers, atomically.
--
-- For each buyer in turn: if the buyer has not bought this coupon and stock is left, take
-- one unit, record the buyer and append the order event. The whole batch runs as one step
-- that no other command can interleave with, so no purchase ever sees the stock between
-- another's check and its decrement. A batch of one is the plain single purchase; larger
-- batches come from concurrent requests merged by the service (see strategy/lua.rs).
--
-- KEYS[1]  stock hash   (field "0" holds the units left)
-- KEYS[2]  buyers set   (user ids)
-- KEYS[3]  orders stream
-- ARGV[1]  coupon id
-- ARGV[2]  time of the purchases, Unix milliseconds
-- ARGV[3], ARGV[4], …  pairs of (user id, order id), one pair per purchase; the order id is
--          chosen by the caller
--
-- Returns  one code per purchase, in order: 1 reserved, 0 sold out, -1 already purchased,
--          -2 stock not loaded (the stock hash is missing: never loaded, or Redis lost it)
local results = {}
local stock = redis.call('HGET', KEYS[1], '0')
if not stock then
  for i = 3, #ARGV, 2 do
    results[#results + 1] = -2
  end
  return results
end
local left = tonumber(stock)
local sold = 0
for i = 3, #ARGV, 2 do
  local user = ARGV[i]
  local code
  if left - sold <= 0 then
    -- Sold out; a buyer who already has one is told so instead.
    if redis.call('SISMEMBER', KEYS[2], user) == 1 then
      code = -1
    else
      code = 0
    end
  elseif redis.call('SADD', KEYS[2], user) == 0 then
    -- SADD answers the membership check and records the buyer in one call.
    code = -1
  else
    sold = sold + 1
    redis.call('XADD', KEYS[3], '*', 'order', ARGV[i + 1], 'coupon', ARGV[1], 'user', user, 'at', ARGV[2])
    code = 1
  end
  results[#results + 1] = code
end
if sold > 0 then
  redis.call('HINCRBY', KEYS[1], '0', -sold)
end
return results

-- reserve.lua: purchases of one coupon by a batch of buyers, atomically.
--
-- For each buyer in turn: if the buyer holds no order of this coupon and stock is left,
-- take one unit, record the buyer's order id and append the order event. The whole batch
-- runs as one step that no other command can interleave with, so no purchase ever sees the
-- stock between another's check and its decrement. A batch of one is the plain single
-- purchase; larger batches come from concurrent requests merged by the service (see
-- strategy/lua.rs).
--
-- The fence makes a lost reply decidable: the caller that got no answer waits until the
-- fence has passed, then reads the buyer's entry. Whatever it finds then is final, because
-- a call that reaches Redis after its fence writes nothing.
--
-- KEYS[1]  stock hash   (field "0" holds the units left)
-- KEYS[2]  buyers hash  (user id -> the order id that user holds; "~ID" while a segmented
--          purchase has claimed the user but not yet sold)
-- KEYS[3]  orders stream
-- ARGV[1]  coupon id
-- ARGV[2]  time of the purchases, Unix milliseconds (the orders' created_at)
-- ARGV[3]  fence, Unix milliseconds: once Redis's clock is past it, nothing is written
-- ARGV[4], ARGV[5], …  pairs of (user id, order id), one pair per purchase
--
-- Returns  one entry per purchase, in order: 1 reserved, 0 sold out, -2 stock not loaded
--          (the stock hash is missing: never loaded, or Redis lost it), -3 fence passed
--          (nothing written), or a string: the order id the buyer already holds
local results = {}
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local stock = redis.call('HGET', KEYS[1], '0')
local refuse = nil
if now > tonumber(ARGV[3]) then
  refuse = -3
elseif not stock then
  refuse = -2
end
if refuse then
  for i = 4, #ARGV, 2 do
    results[#results + 1] = refuse
  end
  return results
end
local left = tonumber(stock)
local sold = 0
for i = 4, #ARGV, 2 do
  local user = ARGV[i]
  local code
  if left - sold <= 0 then
    -- Sold out; a buyer who already holds one is told which.
    code = redis.call('HGET', KEYS[2], user) or 0
  elseif redis.call('HSETNX', KEYS[2], user, ARGV[i + 1]) == 0 then
    -- HSETNX answers the one-per-user check and records the buyer in one call.
    code = redis.call('HGET', KEYS[2], user)
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

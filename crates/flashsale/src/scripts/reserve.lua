-- reserve.lua: one purchase of the `lua` strategy, atomically.
--
-- Checks that the user has not bought this coupon and that stock is left, then takes one
-- unit, records the buyer and appends the order event, all in one step that no other
-- command can interleave with.
--
-- KEYS[1]  stock hash   (field "0" holds the units left)
-- KEYS[2]  buyers set   (user ids)
-- KEYS[3]  orders stream
-- ARGV[1]  user id
-- ARGV[2]  order id     (chosen by the caller, so a retried reply cannot mint two orders)
-- ARGV[3]  coupon id
-- ARGV[4]  time of the purchase, Unix milliseconds
--
-- Returns  1 reserved, 0 sold out, -1 already purchased,
--         -2 stock not loaded (the stock hash is missing: never loaded, or Redis lost it)
local stock = redis.call('HGET', KEYS[1], '0')
if not stock then
  return -2
end
if tonumber(stock) <= 0 then
  -- Sold out; a buyer who already has one is told so instead.
  if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
    return -1
  end
  return 0
end
-- SADD answers the membership check and records the buyer in one call.
if redis.call('SADD', KEYS[2], ARGV[1]) == 0 then
  return -1
end
redis.call('HINCRBY', KEYS[1], '0', -1)
redis.call('XADD', KEYS[3], '*', 'order', ARGV[2], 'coupon', ARGV[3], 'user', ARGV[1], 'at', ARGV[4])
return 1

-- unclaim.lua: withdraws a segmented purchase's claim on a buyer, if it is still that
-- purchase's claim. A claim that became a sale, or another request's entry, is left alone.
--
-- KEYS[1]  buyers hash  (user id -> order id, or a claim "~SETTLE_BY:INSTANCE:ORDER")
-- KEYS[2]  claims sorted set  (user id, scored by settle-by time)
-- ARGV[1]  user id
-- ARGV[2]  the claim
--
-- Returns  1 withdrawn, 0 left alone
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 1
end
return 0

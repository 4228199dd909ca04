-- claim.lua: a segmented purchase claims its buyer before it looks for stock, because
-- two requests of one user may land on two segments. Only one of them gets the claim.
--
-- A claim names the purchase's order, the instance that made it and the time by which
-- its sale is settled one way or the other ("~SETTLE_BY:INSTANCE:ORDER"). A claim still
-- there after that time was left by a crash, and repair_claims.lua removes it.
--
-- KEYS[1]  buyers hash  (user id -> order id, or a claim)
-- KEYS[2]  claims sorted set  (user id, scored by the claim's settle-by time)
-- ARGV[1]  user id
-- ARGV[2]  the claim
-- ARGV[3]  settle-by time, Unix milliseconds
--
-- Returns  1 claimed, or the buyer's entry (an order id or another claim) as a string
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
  return 1
end
return redis.call('HGET', KEYS[1], ARGV[1])

-- record.lua: writes one sale that the caller has already decided under its own guard (a
-- distlock lock, or nothing for the unsafe control): one unit from a segment, the buyer's
-- order id, and the order event, together.
--
-- The fence makes a lost reply decidable, as in reserve.lua: a call that reaches Redis
-- after its fence writes nothing, so once the fence has passed the buyer's entry is final.
--
-- KEYS[1]  stock hash   (segment -> units left)
-- KEYS[2]  buyers hash  (user id -> order id, replacing a segmented claim)
-- KEYS[3]  orders stream
-- KEYS[4]  claims sorted set  (the buyer's claim, if any, is settled by this sale)
-- ARGV[1]  segment
-- ARGV[2]  coupon id
-- ARGV[3]  user id
-- ARGV[4]  order id
-- ARGV[5]  time of the purchase, Unix milliseconds
-- ARGV[6]  fence, Unix milliseconds
-- ARGV[7]  1: write nothing if the segment has no unit left (the lock's check, made again
--          here, so a holder that paused past its lease between its check and this call
--          cannot sell a unit a newer holder sold meanwhile); 0: no check (the unsafe
--          control)
--
-- Returns  1 recorded, 0 the segment is empty (nothing written), -3 fence passed (nothing
--          written)
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
if now > tonumber(ARGV[6]) then
  return -3
end
if ARGV[7] == '1' and tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') <= 0 then
  return 0
end
redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
redis.call('ZREM', KEYS[4], ARGV[3])
redis.call('XADD', KEYS[3], '*', 'order', ARGV[4], 'coupon', ARGV[2], 'user', ARGV[3], 'at', ARGV[5])
return 1

-- load_stock.lua: sets a coupon's stock, unless a live counter is already there.
--
-- The loader adds the known buyers to the buyers set before it calls this, so the counter
-- never exists without them. Refusing to overwrite an existing counter is what keeps a
-- second instance, or a late reload, from handing out stock twice.
--
-- KEYS[1]  stock hash
-- ARGV     units left per segment: ARGV[1] goes to field "0", ARGV[2] to "1", and so on
--
-- Returns  1 loaded, 0 left alone (the counter exists)
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
for segment = 1, #ARGV do
  redis.call('HSET', KEYS[1], tostring(segment - 1), ARGV[segment])
end
return 1

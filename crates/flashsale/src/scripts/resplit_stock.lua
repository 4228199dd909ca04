-- resplit_stock.lua: gives a live counter the segment layout of the strategy now running,
-- keeping its total. `segmented` splits the stock into fields "0".."K-1", every other
-- strategy reads field "0" only; a data directory or fleet restarted with another
-- strategy would otherwise sell only what field "0" holds and answer sold_out for the
-- rest. Atomic, so no sale lands between the sum and the rewrite.
--
-- KEYS[1]  stock hash   (segment -> units left)
-- ARGV[1]  segments the running strategy uses (1 for all but segmented)
--
-- Returns  1 re-split, 0 already in this layout (or no counter)
local segments = tonumber(ARGV[1])
local fields = redis.call('HKEYS', KEYS[1])
if #fields == 0 then
  return 0
end
local same = #fields == segments
if same then
  for _, field in ipairs(fields) do
    local index = tonumber(field)
    if not index or index < 0 or index >= segments then
      same = false
    end
  end
end
if same then
  return 0
end
local total = 0
for _, units in ipairs(redis.call('HVALS', KEYS[1])) do
  total = total + tonumber(units)
end
if total < 0 then
  total = 0
end
redis.call('DEL', KEYS[1])
for segment = 0, segments - 1 do
  local share = math.floor(total / segments)
  if segment < total % segments then
    share = share + 1
  end
  redis.call('HSET', KEYS[1], tostring(segment), share)
end
return 1

-- retire_stream.lua: sets a coupon's order stream aside, with its consumer group, where no
-- worker reads it again, and records where for `reconcile`.
--
-- A new stock authority's tenure, or a new coupon that reuses an old coupon's id after the
-- database was restored, must not store what an earlier one left in the stream: its units
-- may have been sold again since. What it left unstored stays listed, never stored.
--
-- KEYS[1]  the coupon's order stream
-- KEYS[2]  the name to keep it under (same hash tag)
-- KEYS[3]  the set of the coupon's retired streams (same hash tag)
--
-- Returns  1 when a stream was set aside, 0 when there was none
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('SADD', KEYS[3], KEYS[2])
return 1

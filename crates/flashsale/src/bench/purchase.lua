-- purchase.lua: a wrk script. Each request is a purchase by a buyer never seen before, so
-- every request does the full work of a sale rather than a cheap "already purchased".
--
-- Run as: wrk -s purchase.lua URL -- FIRST_USER METHOD
--   URL         http://HOST:PORT/api/coupons/ID/seckill (or /ping, with METHOD GET)
--   FIRST_USER  user ids start here; each wrk thread takes its own block of 10^9 ids
--   METHOD      POST for purchases, GET for the PING floor
--
-- Prints one line "FLASHSALE_WRK {json}" with the run's totals (see report.lua).
local first_user = 0
local next_thread = 0
local sent = 0
local method = "POST"

function setup(thread)
  thread:set("thread_index", next_thread)
  next_thread = next_thread + 1
end

function init(args)
  first_user = tonumber(args[1] or "1") + thread_index * 1000000000
  method = args[2] or "POST"
end

function request()
  sent = sent + 1
  return wrk.format(method, nil, { ["X-User-Id"] = tostring(first_user + sent) }, nil)
end

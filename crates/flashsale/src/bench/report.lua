-- report.lua: appended to every wrk script of the benchmark. Prints the run's totals as
-- one JSON line, so the benchmark reads numbers rather than wrk's human-readable text.
--
-- Output: FLASHSALE_WRK {"requests", "duration_us", "non_2xx", "socket_errors",
--                        "p50_us", "p99_us", "max_us"}
function done(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    '\nFLASHSALE_WRK {"requests":%d,"duration_us":%d,"non_2xx":%d,"socket_errors":%d,' ..
    '"p50_us":%d,"p99_us":%d,"max_us":%d}\n',
    summary.requests, summary.duration, errors.status,
    errors.connect + errors.read + errors.write + errors.timeout,
    latency:percentile(50), latency:percentile(99), latency.max))
end

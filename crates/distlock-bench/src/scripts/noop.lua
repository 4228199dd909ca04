-- The baseline: the cheapest script call there is, so that it measures one EVALSHA round
-- trip and nothing else.
--
-- KEYS  none
-- ARGV  none
-- Returns 1.
return 1

-- Looks, without writing, whether a queued waiter of a fair lock has anything to try for:
-- the cheap check a waiter makes once its channel is subscribed, instead of a second
-- full attempt (fair_acquire.lua). A grant or a "try now" published to the waiter's
-- channel between its queueing attempt and its subscription was not heard; either left
-- a mark this sees: the waiter holds the lock (granted), or the lock is free.
--
-- KEYS[1]  lock hash: field = owner, value = hold count
-- ARGV[1]  owner, "<client uuid>:<n>", queued by an attempt of the same acquisition
--
-- Returns 1 when an attempt is due (the owner holds the lock, or nobody does), 0 while
-- another owner holds it. Fails with a NOPERM error when the user may not read the lock
-- (an attempt then reports it).
if redis.call('exists', KEYS[1]) == 0 or redis.call('hexists', KEYS[1], ARGV[1]) == 1 then
    return 1
end
return 0

-- Release: compare-and-delete, then hand the lock to the next waiter of the queue
-- (`hand_off`), which alone is woken; or a waiter leaving the queue (ARGV[5]); or the
-- cleanup of a waiter's failed attempt, which keeps its turn (ARGV[6]).
-- KEYS[1] lock key, KEYS[2] queue; ARGV[1] owner ('' for a leaving waiter),
-- ARGV[2] channel prefix, ARGV[3] "1" to publish on sharded channels (SPUBLISH, Redis
-- Cluster >= 7), ARGV[4] reservation ms, ARGV[5] id of a waiter leaving the queue (its
-- reservation counts as its key) or '', ARGV[6] 'id:ticket' of the waiter to reserve
-- the key for again or ''.
-- An empty channel prefix hands nothing over: the key is only deleted (a test kit's undo).
-- Returns 1 when the key was ours (and is gone or reserved), 0 otherwise.
if ARGV[5] ~= '' then
  redis.call('ZREM', KEYS[2], ARGV[5])
end
local held = redis.call('GET', KEYS[1])
if held ~= ARGV[1] and not reserved_for(held, ARGV[5]) then
  return 0
end
if ARGV[6] ~= '' then
  redis.call('SET', KEYS[1], '~' .. ARGV[6], 'PX', ARGV[4])
elseif ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
elseif hand_off(KEYS[1], KEYS[2], ARGV[2], ARGV[3], ARGV[4], '') ~= 'reserved' then
  -- Nobody queued: the broadcast wake-up, for those who wait without the queue (sets
  -- of resources, nodes without a queue mixed in one locker).
  redis.call('DEL', KEYS[1])
  if ARGV[3] == '1' then
    redis.call('SPUBLISH', ARGV[2], '')
  else
    redis.call('PUBLISH', ARGV[2], '')
  end
end
return 1

-- The wait queue's case of the release script (after `release_fast.lua`, which holds
-- its arguments, and `hand_off.lua`): a waiter leaving the queue (ARGV[5]), the cleanup
-- of a waiter's failed attempt, which keeps its turn (ARGV[6]), or a release with
-- waiters queued.
local leaving, back_to = ARGV[5] or '', ARGV[6] or ''
local hold = ARGV[4] or '1000'
if leaving ~= '' then
  redis.call('ZREM', KEYS[2], leaving)
end
local held = redis.call('GET', KEYS[1])
if held ~= ARGV[1] and not reserved_for(held, leaving) then
  return 0
end
if back_to ~= '' then
  redis.call('SET', KEYS[1], '~' .. back_to, 'PX', hold)
elseif ARGV[2] == '' then
  redis.call('DEL', KEYS[1])
elseif hand_off(KEYS[1], KEYS[2], ARGV[2], sharded, hold, '') ~= 'reserved' then
  -- Nobody listens in the queue: the broadcast wake-up (see the fast path; written out
  -- in both rather than as a function, which Redis would build on every call of the
  -- script: 1.5k more instructions per release, benches/server_cost.py).
  redis.call('DEL', KEYS[1])
  if sharded == '1' then
    redis.call('SPUBLISH', ARGV[2], '')
  else
    redis.call('PUBLISH', ARGV[2], '')
  end
end
return 1

-- The wait queue's case of the release script (after `release_fast.lua`, which holds
-- its arguments, and `hand_off.lua`): a waiter leaving the queue (ARGV[5]), the cleanup
-- of a waiter's failed attempt, which keeps its turn (ARGV[6]), or a release with
-- waiters queued.
local channel, sharded = ARGV[2] or (KEYS[1] .. ':released'), ARGV[3] or '0'
local leaving, back_to = ARGV[5] or '', ARGV[6] or ''
local hold = ARGV[4] or '1000'
if leaving ~= '' then
  redis.call('ZREM', KEYS[2], leaving)
end
if not ours then
  -- `pcall`: shared holders' sorted set (see `node::modes`) is nobody's key here; any
  -- other type's error is the answer.
  local held = redis.pcall('GET', KEYS[1])
  if held and held.err then
    if redis.call('TYPE', KEYS[1])['ok'] ~= 'zset' then
      return held
    end
    return 0
  end
  if held ~= ARGV[1] and not reserved_for(held, leaving) then
    return 0
  end
end
if back_to ~= '' then
  redis.call('SET', KEYS[1], '~' .. back_to, 'PX', hold)
elseif channel == '' or hand_off(KEYS[1], KEYS[2], channel, sharded, hold, '') ~= 'reserved' then
  -- No waiter listens in the queue (the listeners of the broadcast, if any, were woken
  -- by `hand_off`), or the test kit's undo.
  redis.call('DEL', KEYS[1])
end
return 1

-- The rest of the release script (after `release.lua`, which holds its arguments, and
-- `hand_off.lua`): a release with waiters queued, a set, a shared holder, a waiter
-- leaving the queue (ARGV[4]) or the cleanup of a waiter's failed attempt, which keeps
-- its turn (ARGV[5]).
local sharded, hold = ARGV[2] or '0', ARGV[3] or '1000'
local leaving, back_to = ARGV[4] or '', ARGV[5] or ''
local shared = ARGV[6] == '1'

-- A shared holder leaves (see `node::modes`): the last one's release deletes the key and
-- hands the resource to the queue's next writer that listens (reserved for it, woken
-- alone), or wakes the resource's listeners (the queue's mark '*'), as an exclusive
-- release does; a release that leaves holders wakes the listeners only (a permit
-- waiter), and the key then expires with its last live holder. True when the owner
-- was a live holder.
local function release_shared(lock, queue, channel)
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  local expiry = redis.call('ZSCORE', lock, ARGV[1])
  if not expiry then
    return false
  end
  redis.call('ZREM', lock, ARGV[1])
  redis.call('ZREMRANGEBYSCORE', lock, '-inf', now)
  local last = redis.call('ZRANGE', lock, -1, -1, 'WITHSCORES')
  local live = tonumber(expiry) > now
  if last[1] then
    redis.call('PEXPIRE', lock, tonumber(last[2]) - now)
    if live and channel ~= '' and redis.call('ZREM', queue, '*') == 1 then
      publish(channel, sharded)
    end
  elseif live and channel ~= '' then
    -- `hand_off` reserves the key (a SET) or leaves it gone.
    redis.call('DEL', lock)
    hand_off(lock, queue, channel, sharded, hold, '')
  else
    redis.call('DEL', lock)
  end
  return live
end

local all = 1
for i = 1, #KEYS / 2 do
  local lock, queue = KEYS[2 * i - 1], KEYS[2 * i]
  local channel = ARGV[6 + i] or (lock .. ':released')
  if leaving ~= '' then
    redis.call('ZREM', queue, leaving)
  end
  local holder = ours and ARGV[1] or held(lock)
  if holder and holder.err then
    return holder
  end
  if shared or holder == SHARED then
    if not (shared and holder == SHARED and release_shared(lock, queue, channel)) then
      all = 0
    end
  elseif holder == ARGV[1] or reserved_for(holder, leaving) then
    if back_to ~= '' then
      redis.call('SET', lock, '~' .. back_to, 'PX', hold)
    elseif channel == '' or hand_off(lock, queue, channel, sharded, hold, '') ~= 'reserved' then
      -- No waiter listens in the queue (the listeners of the broadcast, if any, were
      -- woken by `hand_off`), or nothing is handed over.
      redis.call('DEL', lock)
    end
  else
    all = 0
  end
end
return all

-- Release a shared holder (after `hand_off.lua`, see `node::modes`): compare-by-owner
-- removal from the lock key's sorted set. The last holder's release deletes the key and
-- hands the resource to the queue's next writer that listens (reserved for it, woken
-- alone), or wakes the resource's listeners (the queue's mark '*'), as an exclusive
-- release does; a release that leaves holders wakes the listeners only (a permit
-- waiter), and the key then expires with its last live holder.
-- KEYS[1] lock key, KEYS[2] wait queue; ARGV[1] owner, ARGV[2] channel ('' wakes
-- nobody: the cleanup of a failed attempt), ARGV[3] '1' for sharded channels,
-- ARGV[4] reservation ms (`HANDOFF_TTL`).
-- Returns 1 when the owner was a live holder, 0 otherwise.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'zset' then
  return 0
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local live = tonumber(expiry) > now
if last[1] then
  redis.call('PEXPIRE', KEYS[1], tonumber(last[2]) - now)
  if live and ARGV[2] ~= '' and redis.call('ZREM', KEYS[2], '*') == 1 then
    publish(ARGV[2], ARGV[3])
  end
elseif live and ARGV[2] ~= '' then
  -- `hand_off` reserves the key (a SET) or leaves it gone.
  redis.call('DEL', KEYS[1])
  hand_off(KEYS[1], KEYS[2], ARGV[2], ARGV[3], ARGV[4], '')
else
  redis.call('DEL', KEYS[1])
end
if live then
  return 1
end
return 0

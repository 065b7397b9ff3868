-- Store a completed outcome record, only while the lock key holds our owner value.
-- KEYS[1] lock key, KEYS[2] record key.
-- ARGV[1] owner, ARGV[2] token, ARGV[3] fingerprint, ARGV[4] data, ARGV[5] retention ms.
-- Returns 1 when stored, 0 when the lock key is not ours, 2 when a completed record
-- with an equal or larger token exists (a newer outcome is never overwritten). The
-- very record again answers 1: a client that re-sent this store after a dropped
-- connection (redis-rs's cluster client does) finds its first send landed.
-- `pcall`: shared holders' sorted set (see `node::modes`) is not ours; any other
-- type's error is the answer.
local held = redis.pcall('GET', KEYS[1])
if held ~= ARGV[1] then
  if held and held.err and redis.call('TYPE', KEYS[1])['ok'] ~= 'zset' then
    return held
  end
  return 0
end
if redis.call('HGET', KEYS[2], 'state') == 'done' then
  local r = redis.call('HMGET', KEYS[2], 'token', 'fp', 'data')
  if r[1] == ARGV[2] and r[2] == ARGV[3] and r[3] == ARGV[4] then
    return 1
  end
  local t = tonumber(r[1])
  if t and t >= tonumber(ARGV[2]) then
    return 2
  end
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'state', 'done', 'token', ARGV[2], 'fp', ARGV[3], 'data', ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 1

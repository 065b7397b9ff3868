-- Claim a resource's outcome record for the lock holder (idempotent replay).
-- KEYS[1] lock key, KEYS[2] record key (a hash: state, token, fp, data, orphan),
-- KEYS[3] the interrupted attempt's token.
-- ARGV[1] owner, ARGV[2] token, ARGV[3] fingerprint, ARGV[4] pending ttl ms,
-- ARGV[5] ttl ms given once to an earlier holder's marker ('' keeps its ttl),
-- ARGV[6] ms to remember that earlier holder's token ('' remembers nothing).
-- Returns {1, token, fingerprint, data} for a completed record, {0} when the lock key
-- is not ours, {3, pttl} for an earlier holder's marker, {2} when the marker is ours,
-- {4, token} when it is ours and an interrupted attempt's token is remembered.
local state = redis.call('HGET', KEYS[2], 'state')
if state == 'done' then
  local r = redis.call('HMGET', KEYS[2], 'token', 'fp', 'data')
  return {1, r[1], r[2], r[3]}
end
-- `pcall`: shared holders' sorted set (see `node::modes`) is not ours; any other
-- type's error is the answer.
local held = redis.pcall('GET', KEYS[1])
if held ~= ARGV[1] then
  if held and held.err and redis.call('TYPE', KEYS[1])['ok'] ~= 'zset' then
    return held
  end
  return {0}
end
if state == 'pending' and redis.call('HGET', KEYS[2], 'token') ~= ARGV[2] then
  if redis.call('HSETNX', KEYS[2], 'orphan', '1') == 1 then
    if ARGV[5] ~= '' then
      redis.call('PEXPIRE', KEYS[2], ARGV[5])
    end
    if ARGV[6] ~= '' then
      redis.call('SET', KEYS[3], redis.call('HGET', KEYS[2], 'token'), 'PX', ARGV[6])
    end
  end
  return {3, redis.call('PTTL', KEYS[2])}
end
if state ~= 'pending' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'state', 'pending', 'token', ARGV[2], 'fp', ARGV[3])
  redis.call('PEXPIRE', KEYS[2], ARGV[4])
end
local interrupted = redis.call('GET', KEYS[3])
if interrupted then
  return {4, interrupted}
end
return {2}

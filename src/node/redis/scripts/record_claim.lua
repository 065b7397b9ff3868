-- Claim a resource's outcome record for the lock holder (idempotent replay).
-- KEYS[1] lock key, KEYS[2] record key (a hash: state, token, fp, data, orphan).
-- ARGV[1] owner, ARGV[2] token, ARGV[3] fingerprint, ARGV[4] pending ttl ms,
-- ARGV[5] ttl ms given once to an earlier holder's marker ('' keeps its ttl).
-- Returns {1, token, fingerprint, data} for a completed record, {0} when the lock key
-- is not ours, {3, pttl} for an earlier holder's marker, {2} when the marker is ours.
local state = redis.call('HGET', KEYS[2], 'state')
if state == 'done' then
  local r = redis.call('HMGET', KEYS[2], 'token', 'fp', 'data')
  return {1, r[1], r[2], r[3]}
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {0}
end
if state == 'pending' then
  if redis.call('HGET', KEYS[2], 'token') == ARGV[2] then
    return {2}
  end
  if redis.call('HSETNX', KEYS[2], 'orphan', '1') == 1 and ARGV[5] ~= '' then
    redis.call('PEXPIRE', KEYS[2], ARGV[5])
  end
  return {3, redis.call('PTTL', KEYS[2])}
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'state', 'pending', 'token', ARGV[2], 'fp', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return {2}

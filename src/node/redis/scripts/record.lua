-- A resource's outcome record (idempotent replay, see `lock/record/`), after `held.lua`:
-- claim it for the lock holder, store a completed outcome, or discard a pending marker.
-- KEYS[1] lock key, KEYS[2] record key (a hash: state, token, fp, data, orphan),
-- KEYS[3] the interrupted attempt's token (one hash tag); ARGV[1] 'claim', 'store' or
-- 'discard', then the operation's own arguments:
-- claim: ARGV[2] owner, ARGV[3] token, ARGV[4] fingerprint, ARGV[5] pending ttl ms,
-- ARGV[6] ttl ms given once to an earlier holder's marker ('' keeps its ttl),
-- ARGV[7] ms to remember that earlier holder's token ('' remembers nothing).
-- Returns {1, token, fingerprint, data} for a completed record, {0} when the lock key
-- is not ours, {3, pttl} for an earlier holder's marker, {2} when the marker is ours,
-- {4, token} when it is ours and an interrupted attempt's token is remembered.
-- store, only while the lock key holds our owner value: ARGV[2] owner, ARGV[3] token,
-- ARGV[4] fingerprint, ARGV[5] data, ARGV[6] retention ms.
-- Returns 1 when stored, 0 when the lock key is not ours, 2 when a completed record
-- with an equal or larger token exists (a newer outcome is never overwritten). The
-- very record again answers 1: a client that re-sent this store after a dropped
-- connection (redis-rs's cluster client does) finds its first send landed.
-- discard: ARGV[2] token. Deletes a pending marker of that token (completed records
-- and other markers stay). Returns 1 when deleted, 0 otherwise.
local op = ARGV[1]
local state = redis.call('HGET', KEYS[2], 'state')

if op == 'discard' then
  if state == 'pending' and redis.call('HGET', KEYS[2], 'token') == ARGV[2] then
    redis.call('DEL', KEYS[2])
    return 1
  end
  return 0
end

if op == 'claim' and state == 'done' then
  local r = redis.call('HMGET', KEYS[2], 'token', 'fp', 'data')
  return {1, r[1], r[2], r[3]}
end
local holder = held(KEYS[1])
if holder ~= ARGV[2] then
  if holder and holder.err then
    return holder
  end
  if op == 'claim' then
    return {0}
  end
  return 0
end

if op == 'store' then
  if state == 'done' then
    local r = redis.call('HMGET', KEYS[2], 'token', 'fp', 'data')
    if r[1] == ARGV[3] and r[2] == ARGV[4] and r[3] == ARGV[5] then
      return 1
    end
    local t = tonumber(r[1])
    if t and t >= tonumber(ARGV[3]) then
      return 2
    end
  end
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'state', 'done', 'token', ARGV[3], 'fp', ARGV[4], 'data', ARGV[5])
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
  return 1
end

if state == 'pending' and redis.call('HGET', KEYS[2], 'token') ~= ARGV[3] then
  if redis.call('HSETNX', KEYS[2], 'orphan', '1') == 1 then
    if ARGV[6] ~= '' then
      redis.call('PEXPIRE', KEYS[2], ARGV[6])
    end
    if ARGV[7] ~= '' then
      redis.call('SET', KEYS[3], redis.call('HGET', KEYS[2], 'token'), 'PX', ARGV[7])
    end
  end
  return {3, redis.call('PTTL', KEYS[2])}
end
if state ~= 'pending' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'state', 'pending', 'token', ARGV[3], 'fp', ARGV[4])
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
end
local interrupted = redis.call('GET', KEYS[3])
if interrupted then
  return {4, interrupted}
end
return {2}

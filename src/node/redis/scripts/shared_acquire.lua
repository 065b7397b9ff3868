-- Acquire a shared holder (a reader, or one of n permits) of a resource, after
-- `fence_rule.lua` (see `node::modes`). The lock key is then a sorted set: owner ->
-- expiry (server ms), the key itself expiring with its last holder, so that an
-- exclusive `SET NX` finds it free exactly when every holder is gone.
-- The holders' limit is kept beside them (KEYS[5], absent for readers), living at
-- least as long as the set: every holder of a resource holds it with one limit.
-- KEYS[1] lock key, KEYS[2] fence counter, KEYS[3] wait queue, KEYS[4] a waiting
-- writer's intent, KEYS[5] the holders' limit (same hash tag).
-- ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] fence ttl ms, ARGV[4] floor (client clock ms
-- * 2^10, decimal), ARGV[5] '1' fenced, '0' no counter (token 0), ARGV[6] the most
-- holders at once, '0' for no limit (a reader).
-- Returns {1, token} when granted, {0, pttl} when refused: the writer's ttl, the
-- intent's, or the earliest permit's expiry; {2, limit} when the live holders hold it
-- with another limit ('0': readers).
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'zset' then
  -- A writer holds the key, or it is reserved for a waiting writer.
  return {0, redis.call('PTTL', KEYS[1])}
end
-- Writer preference: an intent still live, and a writer still queued (the listeners'
-- mark '*' is scored +inf, so a head of '*' means no writer waits).
if redis.call('EXISTS', KEYS[4]) == 1 then
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  if head and head ~= '*' then
    return {0, redis.call('PTTL', KEYS[4])}
  end
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local fresh = true
if kind == 'zset' then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  local holders = redis.call('ZCARD', KEYS[1])
  fresh = holders == 0
  if not fresh and not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
    local held = redis.call('GET', KEYS[5]) or '0'
    if held ~= ARGV[6] then
      return {2, held}
    end
    local limit = tonumber(ARGV[6])
    if limit > 0 and holders >= limit then
      local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
      return {0, tonumber(first[2]) - now}
    end
  end
end
-- The counter is checked before anything is written.
local ok, n = true, nil
if ARGV[5] ~= '0' then
  ok, n = counter(KEYS[2])
  if not ok then
    return n
  end
end
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
  if ARGV[6] ~= '0' then
    redis.call('SET', KEYS[5], ARGV[6], 'PX', ttl)
  end
end
if fresh and ARGV[6] == '0' then
  -- The limit of permits whose set is gone.
  redis.call('DEL', KEYS[5])
end
if ARGV[5] == '0' then
  return {1, 0}
end
return {1, next_token(KEYS[2], n, ARGV[4], ARGV[3], false)}

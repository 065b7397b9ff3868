-- Acquire one resource or a set of them, exclusively or as a shared holder, each
-- granted resource's fence counter stepped by `fence_rule.lua` (see `fencing`), behind
-- the waiters of the wait queue (see `Node::wait_queue`). One script in five parts
-- (`call::ACQUIRE`): `held.lua`, `fence_rule.lua`, this part (what needs none of the
-- queue's functions: the fast path, the common case of a caller that does not wait with
-- nobody queued; a set; shared holders), then `hand_off.lua` and `acquire_queued.lua`,
-- the wait queue's case of one resource.
-- KEYS: per resource its lock key, fence counter and wait queue (one hash tag per
-- resource; a set's members differ, so a cluster never runs a set); shared holders
-- add a waiting writer's intent and the holders' limit (KEYS[4], KEYS[5]).
-- ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] fence ttl ms,
-- ARGV[4] floor: client clock ms * 2^10 as a decimal string;
-- then, left out by a fenced caller that does not wait on a standalone server (Redis
-- charges every argument, see BENCHMARKS.md), with their defaults:
-- ARGV[5] '1' fenced (default), '0' lock key only (token 0), 's' fenced with the floor
-- applied only when the counter is missing (test hook),
-- ARGV[6] channel prefix (default: the lock key and ':released', as `ResourceKeys`),
-- ARGV[7] '1' for sharded channels (default '0'), ARGV[8] reservation ms (default
-- 1000, `HANDOFF_TTL`);
-- a waiting caller only: ARGV[9] waiter id, ARGV[10] its ticket, ARGV[11] queue ttl ms
-- ('' and '0' for a caller that does not wait but sends what follows);
-- ARGV[12] '1': the caller's own pipelined SET NX just took the key (`fence.lua`) and
-- found waiters queued: the queue's check is done here, as for a key found free.
-- A set sends ARGV[1] to ARGV[5]. Shared holders (the only call with five keys) send
-- ARGV[1] to ARGV[5] and ARGV[6]: the most holders at once, '0' for readers.
-- Returns {1, token, ...} (one per resource) when granted; {0, pttl, i} when someone
-- else holds or was handed resource i (pttl: the longest remaining ttl of those held);
-- {2, limit} when live shared holders hold it with another limit ('0': readers).

local fencing = ARGV[5] or '1'

if not ARGV[9] and #KEYS == 3 and redis.call('EXISTS', KEYS[3]) == 0 then
  local fresh = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  -- Our own key when not fresh: an earlier send of this very call landed before its
  -- connection broke and this is the resend. Same grant, with this round's counter;
  -- the counter write also lets a pipelined WAIT cover the earlier SET (it precedes it).
  -- Shared holders read as another holder. Only a refused SET pays for the GET.
  if not fresh then
    local holder = held(KEYS[1])
    if holder ~= ARGV[1] then
      if holder and holder.err then
        return holder
      end
      return {0, redis.call('PTTL', KEYS[1])}
    end
  end
  if fencing == '0' then
    return {1, 0}
  end
  local ok, n = counter(KEYS[2])
  if not ok then
    -- No lock key of ours is left behind.
    if fresh then
      redis.call('DEL', KEYS[1])
    end
    return n
  end
  return {1, next_token(KEYS[2], n, ARGV[4], ARGV[3], fencing == 's')}
end

if #KEYS == 5 then
  -- A shared holder (a reader, or one of n permits, see `node::modes`): the lock key is
  -- then a sorted set, owner -> expiry (server ms), the key itself expiring with its
  -- last holder, so that an exclusive `SET NX` finds it free exactly when every holder
  -- is gone. The holders' limit is kept beside them, living at least as long as the
  -- set: every holder of a resource holds it with one limit.
  local limit = ARGV[6]
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
      local theirs = redis.call('GET', KEYS[5]) or '0'
      if theirs ~= limit then
        return {2, theirs}
      end
      if tonumber(limit) > 0 and holders >= tonumber(limit) then
        local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
        return {0, tonumber(first[2]) - now}
      end
    end
  end
  -- The counter is checked before anything is written.
  local ok, n = true, nil
  if fencing ~= '0' then
    ok, n = counter(KEYS[2])
    if not ok then
      return n
    end
  end
  local ttl = tonumber(ARGV[2])
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  if redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
    if limit ~= '0' then
      redis.call('SET', KEYS[5], limit, 'PX', ttl)
    end
  end
  if fresh and limit == '0' then
    -- The limit of permits whose set is gone.
    redis.call('DEL', KEYS[5])
  end
  if fencing == '0' then
    return {1, 0}
  end
  return {1, next_token(KEYS[2], n, ARGV[4], ARGV[3], fencing == 's')}
end

if #KEYS > 3 then
  -- A set, all or nothing: every member is checked before anything is written, so a
  -- held member or a counter of the wrong type fails the call with nothing written.
  -- A set does not queue: its waiters listen on each member's channel (`hand_off`).
  local counters, first, longest = {}, nil, nil
  for i = 1, #KEYS / 3 do
    if fencing ~= '0' then
      local ok, n = counter(KEYS[3 * i - 1])
      if not ok then
        return n
      end
      counters[i] = n or false
    end
    local lock = KEYS[3 * i - 2]
    local holder = held(lock)
    if holder and holder.err then
      return holder
    end
    -- Our own value: the resend of an earlier send (as above), the same grant.
    if holder and holder ~= ARGV[1] then
      local pttl = redis.call('PTTL', lock)
      first = first or i
      if not longest or pttl > longest then
        longest = pttl
      end
    end
  end
  if first then
    return {0, longest, first}
  end
  local reply = {1}
  for i = 1, #KEYS / 3 do
    redis.call('SET', KEYS[3 * i - 2], ARGV[1], 'PX', ARGV[2])
    if fencing == '0' then
      reply[i + 1] = 0
    else
      local fence = KEYS[3 * i - 1]
      reply[i + 1] = next_token(fence, counters[i] or nil, ARGV[4], ARGV[3], fencing == 's')
    end
  end
  return reply
end

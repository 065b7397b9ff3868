-- The wait queue's case of the acquire script, for one exclusive resource (after
-- `acquire.lua`, which holds its arguments, and `hand_off.lua`): a caller that waits,
-- or a queue with waiters in it.
-- Waiters are ordered by (ticket, id) on every node alike: the queue's order, and the
-- order in which a waiter may take a key reserved for a later one.
local me = ARGV[9] or ''
local channel, sharded = ARGV[6] or (KEYS[1] .. ':released'), ARGV[7] or '0'
local hold = ARGV[8] or '1000'

-- Refused: a waiting caller joins the queue, or keeps its place (same ticket, same id).
local function refuse()
  if me ~= '' then
    redis.call('ZADD', KEYS[3], ARGV[10], me)
    redis.call('PEXPIRE', KEYS[3], ARGV[11])
  end
  return {0, redis.call('PTTL', KEYS[1])}
end

-- We hold a key that was free: the queue's head still comes first (no barging), unless
-- we come before it (a waiter taken off this queue earlier, whose turn it still is).
-- True when the key went to the head instead.
local function yields()
  local top = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  local head = top[1]
  -- The listeners' mark alone (see `hand_off`): no waiter comes first.
  if head == '*' then
    return false
  end
  if head == me then
    redis.call('ZREM', KEYS[3], me)
    return false
  end
  return head ~= nil and not (me ~= '' and before(ARGV[10], me, top[2], head))
    and hand_off(KEYS[1], KEYS[3], channel, sharded, hold, me) == 'reserved'
end

-- The counter (none without fencing).
local function fence_counter()
  if fencing == '0' then
    return true, nil
  end
  return counter(KEYS[2])
end

local ok, n
-- A waiter reads the key first: it mostly finds it held (and joins the queue) or
-- reserved for it (it was woken), where a SET NX would only be refused; a caller that
-- does not wait mostly finds it free.
local fresh, holder
if me ~= '' then
  holder = held(KEYS[1])
  fresh = not holder and redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
else
  fresh = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  holder = not fresh and held(KEYS[1])
end
if holder and holder.err then
  return holder
end
if holder == SHARED then
  -- Shared holders: a waiting writer leaves its intent for its queue ttl, which keeps
  -- new shared holders out while it is queued (writer preference), and queues.
  if me ~= '' then
    redis.call('SET', KEYS[1] .. ':writer', me, 'PX', ARGV[11])
  end
  return refuse()
end
if fresh then
  if yields() then
    return refuse()
  end
  ok, n = fence_counter()
  if not ok then
    redis.call('DEL', KEYS[1])
    return n
  end
else
  if holder == ARGV[1] then
    -- Our own key: the resend of an earlier send (see the fast path), or the key our
    -- own pipelined SET NX just took (ARGV[12]), which the queue's head may come before.
    if ARGV[12] == '1' and yields() then
      return refuse()
    end
    ok, n = fence_counter()
  else
    local id, ticket = string.match(holder, '^~([^:]*):(.*)$')
    if not id or me == '' then
      return refuse()
    end
    if id ~= me then
      -- Reserved for a later waiter (this node handed it on while we were being
      -- served elsewhere): we come first, on every node alike, and it keeps its place.
      if not before(ARGV[10], me, ticket, id) then
        return refuse()
      end
      redis.call('ZADD', KEYS[3], ticket, id)
      redis.call('ZREM', KEYS[3], me)
      redis.call('PEXPIRE', KEYS[3], ARGV[11])
    end
    -- Handed to us: take it.
    ok, n = fence_counter()
    if ok then
      redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    end
  end
  if not ok then
    return n
  end
end
if fencing == '0' then
  return {1, 0}
end
return {1, next_token(KEYS[2], n, ARGV[4], ARGV[3], fencing == 's')}

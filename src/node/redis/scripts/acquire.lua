-- Acquire with a fence counter floored by the acquiring client's clock (see `fencing`),
-- behind the waiters of the wait queue (see `Node::wait_queue`; `hand_off` precedes this).
-- KEYS[1] lock key, KEYS[2] fence counter, KEYS[3] queue (same hash tag).
-- ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] fence ttl ms,
-- ARGV[4] floor: client clock ms * 2^10 as a decimal string,
-- ARGV[5] '1' to apply the floor only when the counter is missing (test hook),
-- ARGV[6] '1' to keep the fence counter ('0': lock key only, token 0),
-- ARGV[7] waiter id ('' when the caller does not wait), ARGV[8] its ticket,
-- ARGV[9] queue ttl ms, ARGV[10] channel prefix, ARGV[11] '1' for sharded channels,
-- ARGV[12] reservation ms.
-- Returns {1, token} when granted, {0, pttl} when someone else holds or was handed the key.
-- Waiters are ordered by (ticket, id) on every node alike: the queue's order, and the
-- order in which a waiter may take a key reserved for a later one.
local me = ARGV[7]

-- Refused: a waiting caller joins the queue, or keeps its place (same ticket, same id).
local function refuse()
  if me ~= '' then
    redis.call('ZADD', KEYS[3], ARGV[8], me)
    redis.call('PEXPIRE', KEYS[3], ARGV[9])
  end
  return {0, redis.call('PTTL', KEYS[1])}
end

-- The counter, checked before the grant is kept: a counter of the wrong type (a string
-- that is no integer, or another type, which GET refuses: pcall, so that the refusal
-- does not end the script after our SET) fails every attempt with the server's error
-- and leaves no lock key of ours behind.
local function counter()
  if ARGV[6] ~= '1' then
    return true, nil
  end
  local cur = redis.pcall('GET', KEYS[2])
  -- `cur.err` is nil on a string (strings index the string library); globals such as
  -- `type` or `math` cost more in Redis's sandbox than the rest of the check.
  if cur and cur.err then
    return false, cur
  end
  local n = cur and tonumber(cur)
  if cur and not (n and n >= 0 and n % 1 == 0) then
    return false, redis.error_reply('ERR fence counter ' .. KEYS[2] .. ' is not an integer')
  end
  return true, n
end

local ok, n
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  -- The key was free; the queue's head still comes first (no barging), unless we come
  -- before it (a waiter taken off this queue earlier, whose turn it still is).
  local top = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  local head = top[1]
  if head == me then
    redis.call('ZREM', KEYS[3], me)
  elseif head and not (me ~= '' and before(ARGV[8], me, top[2], head)) then
    if hand_off(KEYS[1], KEYS[3], ARGV[10], ARGV[11], ARGV[12], me) == 'reserved' then
      return refuse()
    end
  end
  ok, n = counter()
  if not ok then
    redis.call('DEL', KEYS[1])
    return n
  end
else
  local holder = redis.call('GET', KEYS[1])
  if holder == ARGV[1] then
    -- Our own key: an earlier send of this very call landed before its connection broke
    -- and this is the resend. Same grant, with this round's counter; the counter write
    -- below also lets a pipelined WAIT cover the earlier SET (it precedes it).
    ok, n = counter()
  else
    local id, ticket = string.match(holder, '^~([^:]*):(.*)$')
    if not id or me == '' then
      return refuse()
    end
    if id ~= me then
      -- Reserved for a later waiter (this node handed it on while we were being
      -- served elsewhere): we come first, on every node alike, and it keeps its place.
      if not before(ARGV[8], me, ticket, id) then
        return refuse()
      end
      redis.call('ZADD', KEYS[3], ticket, id)
      redis.call('ZREM', KEYS[3], me)
      redis.call('PEXPIRE', KEYS[3], ARGV[9])
    end
    -- Handed to us: take it.
    ok, n = counter()
    if ok then
      redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    end
  end
  if not ok then
    return n
  end
end
if ARGV[6] ~= '1' then
  return {1, 0}
end
-- max(counter + 1, floor). Tokens stay below 2^53, so tonumber is exact; the +1 itself
-- is done by INCR, and the floor is stored as the caller's string, so no large number
-- is ever formatted by Lua. At the floor (the usual case: the last grant was more than
-- a millisecond ago) one SET writes the counter and its ttl.
if n and (ARGV[5] == '1' or n + 1 >= tonumber(ARGV[4])) then
  local token = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return {1, token}
end
redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[3])
return {1, ARGV[4]}

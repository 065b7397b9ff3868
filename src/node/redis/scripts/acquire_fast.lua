-- Acquire with a fence counter floored by the acquiring client's clock (see `fencing`),
-- behind the waiters of the wait queue (see `Node::wait_queue`). One script in three
-- parts (`call::ACQUIRE`): this fast path, the common case (a caller that does not
-- wait, and nobody queued), which builds none of the queue's functions; then
-- `hand_off.lua` and `acquire.lua`, the wait queue's case.
-- KEYS[1] lock key, KEYS[2] fence counter, KEYS[3] queue (same hash tag).
-- ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] fence ttl ms,
-- ARGV[4] floor: client clock ms * 2^10 as a decimal string;
-- then, left out by a fenced caller that does not wait on a standalone server (Redis
-- charges every argument, see BENCHMARKS.md), with their defaults:
-- ARGV[5] '1' fenced (default), '0' lock key only (token 0), 's' fenced with the floor
-- applied only when the counter is missing (test hook),
-- ARGV[6] channel prefix (default: the lock key and ':released', as `LockKeys`),
-- ARGV[7] '1' for sharded channels (default '0'), ARGV[8] reservation ms (default
-- 1000, `HANDOFF_TTL`);
-- a waiting caller only: ARGV[9] waiter id, ARGV[10] its ticket, ARGV[11] queue ttl ms.
-- Returns {1, token} when granted, {0, pttl} when someone else holds or was handed the key.

local mode = ARGV[5] or '1'

-- The counter, checked before the grant is kept: a counter of the wrong type (a string
-- that is no integer, or another type, which GET refuses: pcall, so that the refusal
-- does not end the script after our SET) fails every attempt with the server's error
-- and leaves no lock key of ours behind.
local function counter()
  if mode == '0' then
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

-- The grant with its token, max(counter + 1, floor), from the counter `n`. Tokens stay
-- below 2^53, so tonumber is exact; the +1 itself is done by INCR, and the floor is
-- stored as the caller's string, so no large number is ever formatted by Lua. At the
-- floor (the usual case: the last grant was more than a millisecond ago) one SET
-- writes the counter and its ttl.
local function grant(n)
  if mode == '0' then
    return {1, 0}
  end
  if n and (mode == 's' or n + 1 >= tonumber(ARGV[4])) then
    local token = redis.call('INCR', KEYS[2])
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
    return {1, token}
  end
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[3])
  return {1, ARGV[4]}
end

if not ARGV[9] and redis.call('EXISTS', KEYS[3]) == 0 then
  local fresh = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  -- Our own key when not fresh: an earlier send of this very call landed before its
  -- connection broke and this is the resend. Same grant, with this round's counter;
  -- the counter write also lets a pipelined WAIT cover the earlier SET (it precedes it).
  if not fresh and redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return {0, redis.call('PTTL', KEYS[1])}
  end
  local ok, n = counter()
  if not ok then
    if fresh then
      redis.call('DEL', KEYS[1])
    end
    return n
  end
  return grant(n)
end

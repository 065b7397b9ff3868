-- Acquire with a fence counter floored by the acquiring client's clock (see `fencing`),
-- behind the waiters of the wait queue (see `Node::wait_queue`). One script in four
-- parts (`call::ACQUIRE`): `fence_rule.lua`; this fast path, the common case (a caller
-- that does not wait, nobody queued), which builds none of the queue's functions; then
-- `hand_off.lua` and `acquire.lua`, the wait queue's case.
-- KEYS[1] lock key, KEYS[2] fence counter, KEYS[3] queue (same hash tag).
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
-- ('' and '0' for a caller that does not wait but sends ARGV[12]);
-- ARGV[12] '1': the caller's own pipelined SET NX just took the key (`fence.lua`) and
-- found waiters queued: the queue's check is done here, as for a key found free.
-- Returns {1, token} when granted, {0, pttl} when someone else holds or was handed the key.

local mode = ARGV[5] or '1'

if not ARGV[9] and redis.call('EXISTS', KEYS[3]) == 0 then
  local fresh = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  -- Our own key when not fresh: an earlier send of this very call landed before its
  -- connection broke and this is the resend. Same grant, with this round's counter;
  -- the counter write also lets a pipelined WAIT cover the earlier SET (it precedes it).
  -- `pcall`: shared holders keep a sorted set at the key (see `node::modes`), which GET
  -- refuses; that error reads as another holder, any other type's is the answer. Only
  -- a refused SET pays for it.
  if not fresh then
    local holder = redis.pcall('GET', KEYS[1])
    if holder ~= ARGV[1] then
      if holder and holder.err and redis.call('TYPE', KEYS[1])['ok'] ~= 'zset' then
        return holder
      end
      return {0, redis.call('PTTL', KEYS[1])}
    end
  end
  if mode == '0' then
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
  return {1, next_token(KEYS[2], n, ARGV[4], ARGV[3], mode == 's')}
end

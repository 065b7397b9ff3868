-- Release one hold of one resource or of a set: compare-and-delete each lock key (or,
-- for a shared holder, its entry in the sorted set at the key), then hand each resource
-- to the next waiter of its queue (`hand_off`), which alone is woken. One script in
-- four parts (`call::RELEASE`): this fast path (the common case: a lease's own release
-- of one resource, nobody queued), which builds no function, then `held.lua`,
-- `hand_off.lua` and `release_queued.lua`.
-- KEYS: per resource its lock key and its wait queue. ARGV[1] owner ('' for a
-- leaving waiter); then, left out by a lease's own release of one resource on a
-- standalone server (the fast path; Redis charges every argument, see BENCHMARKS.md),
-- with their defaults:
-- ARGV[2] '1' to publish on sharded channels (SPUBLISH, Redis Cluster >= 7; default
-- '0'), ARGV[3] reservation ms (default 1000, `HANDOFF_TTL`); for a waiter's calls:
-- ARGV[4] id of a waiter leaving the queue (its reservation counts as its key) or '',
-- ARGV[5] 'id:ticket' of the waiter to reserve the key for again or '';
-- ARGV[6] '1' for a shared holder (see `node::modes`), else '0';
-- ARGV[6 + i] resource i's channel prefix (default: the lock key and ':released', as
-- `ResourceKeys`; empty hands nothing over: the key is only deleted, the cleanup of a
-- failed attempt or a test kit's undo).
-- Returns 1 when every key was ours (and is gone or reserved), 0 otherwise: an
-- exclusive release never touches shared holders, nor a shared one a lock key's string.
-- `ours`: the fast path found the key ours (`release_queued.lua` need not read it again).
local ours = false
if not ARGV[2] then
  -- GET inline rather than `held` (`held.lua` follows this part): Redis makes a script's
  -- closures on every call, and this path needs none (BENCHMARKS.md). A shared holders'
  -- sorted set is not ours either; GET's refusal of any other type is the answer.
  local holder = redis.pcall('GET', KEYS[1])
  if holder == ARGV[1] then
    -- Nobody queued and nobody listening (the queue holds the listeners' mark, see
    -- `hand_off`): nothing to wake.
    if redis.call('EXISTS', KEYS[2]) == 0 then
      redis.call('DEL', KEYS[1])
      return 1
    end
    ours = true
  else
    if holder and holder.err and redis.call('TYPE', KEYS[1])['ok'] ~= 'zset' then
      return holder
    end
    return 0
  end
end

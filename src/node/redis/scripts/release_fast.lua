-- Release: compare-and-delete, then hand the lock to the next waiter of the queue
-- (`hand_off`), which alone is woken. One script in three parts (`call::RELEASE`):
-- this fast path, the common case (a lease's own release with nobody queued), which
-- builds none of the queue's functions; then `hand_off.lua` and `release.lua`.
-- KEYS[1] lock key, KEYS[2] queue; ARGV[1] owner ('' for a leaving waiter); then, left
-- out by a lease's own release on a standalone server (the fast path; Redis charges
-- every argument, see BENCHMARKS.md), with their defaults:
-- ARGV[2] channel prefix (default: the lock key and ':released', as `ResourceKeys`; empty
-- hands nothing over: the key is only deleted, a test kit's undo),
-- ARGV[3] "1" to publish on sharded channels (SPUBLISH, Redis Cluster >= 7; default
-- "0"), ARGV[4] reservation ms (default 1000, `HANDOFF_TTL`); only for a waiter's
-- calls: ARGV[5] id of a waiter leaving the queue (its reservation counts as its key)
-- or '', ARGV[6] 'id:ticket' of the waiter to reserve the key for again or ''.
-- Returns 1 when the key was ours (and is gone or reserved), 0 otherwise.
-- `ours`: the fast path found the key ours (`release.lua` need not read it again).
local ours = false
if not ARGV[2] then
  -- `pcall`: shared holders' sorted set (see `node::modes`) is not ours either; any
  -- other type's error is the answer.
  local held = redis.pcall('GET', KEYS[1])
  if held ~= ARGV[1] then
    if held and held.err and redis.call('TYPE', KEYS[1])['ok'] ~= 'zset' then
      return held
    end
    return 0
  end
  -- Nobody queued and nobody listening (the queue holds the listeners' mark, see
  -- `hand_off`): nothing to wake.
  if redis.call('EXISTS', KEYS[2]) == 0 then
    redis.call('DEL', KEYS[1])
    return 1
  end
  ours = true
end

-- Release a set (after `hand_off.lua`): compare-and-delete every member, each as
-- release.lua does one: the member's lock goes to the next waiter of its queue that
-- listens (reserved for it, which alone is woken), else it is deleted (the listeners
-- of the member's own channel, marked in the queue, are woken by `hand_off`).
-- KEYS[2i-1] member i's lock key, KEYS[2i] its wait queue; ARGV[1] owner, ARGV[2] "1"
-- to publish on sharded channels (SPUBLISH), else PUBLISH; ARGV[3] reservation ms
-- (`HANDOFF_TTL`); ARGV[i + 3] member i's wake-up channel, empty to hand nothing over
-- (the cleanup of a failed attempt: the key is only deleted).
-- Returns 1 when every member was ours (and is gone or reserved), 0 otherwise.
local all = 1
for i = 1, #KEYS / 2 do
  local lock, queue = KEYS[2 * i - 1], KEYS[2 * i]
  -- `pcall`: shared holders' sorted set (see `node::modes`) is not ours; any other
  -- type's error is the answer.
  local held = redis.pcall('GET', lock)
  if held and held.err and redis.call('TYPE', lock)['ok'] ~= 'zset' then
    return held
  end
  if held == ARGV[1] then
    local channel = ARGV[i + 3]
    if channel == '' or hand_off(lock, queue, channel, ARGV[2], ARGV[3], '') ~= 'reserved' then
      redis.call('DEL', lock)
    end
  else
    all = 0
  end
end
return all

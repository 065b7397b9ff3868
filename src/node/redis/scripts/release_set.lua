-- Release a set: compare-and-delete every member, waking the waiters of each member
-- deleted on its channel (as release.lua does one).
-- KEYS[i] member i's lock key; ARGV[1] owner, ARGV[2] "1" to publish on the sharded
-- channel (SPUBLISH), else PUBLISH; ARGV[i + 2] member i's wake-up channel, empty to
-- wake no one (the cleanup of a failed attempt).
-- Returns 1 when every member was ours and deleted, 0 otherwise.
local all = 1
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    local channel = ARGV[i + 2]
    -- Through `redis.pcall`, after the DEL: a refused wake-up (NOPERM) must not stop
    -- the script before the other members are deleted.
    if channel == '' then
      -- nothing to wake
    elseif ARGV[2] == '1' then
      redis.pcall('SPUBLISH', channel, '')
    else
      redis.pcall('PUBLISH', channel, '')
    end
  else
    all = 0
  end
end
return all

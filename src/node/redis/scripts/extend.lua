-- Extend: compare-and-pexpire on every lock key, one ttl for all (after `held.lua`).
-- Never re-creates a missing key or holder: a lost lease stays lost.
-- KEYS[i] lock key; ARGV[1] ttl ms, ARGV[i + 1] the owner KEYS[i] must hold;
-- ARGV[#KEYS + 2] '1' for shared holders (see `node::modes`), found in the sorted set
-- at the key: each one's expiry becomes now + ttl if it is still live, and the set and
-- the holders' limit (`:limit` beside the key, same hash tag) live at least that long.
-- Returns one flag per key, in order: 1 extended, 0 not ours.
local extended, now = {}, nil
local ttl, shared = ARGV[1], ARGV[#KEYS + 2] == '1'

for i, key in ipairs(KEYS) do
  local holder = held(key)
  extended[i] = 0
  if holder and holder.err then
    return holder
  elseif holder == ARGV[i + 1] and not shared then
    redis.call('PEXPIRE', key, ttl)
    extended[i] = 1
  elseif holder == SHARED and shared then
    if not now then
      local time = redis.call('TIME')
      now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
    end
    local expiry = redis.call('ZSCORE', key, ARGV[i + 1])
    if expiry and tonumber(expiry) > now then
      redis.call('ZADD', key, 'XX', now + tonumber(ttl), ARGV[i + 1])
      if redis.call('PTTL', key) < tonumber(ttl) then
        redis.call('PEXPIRE', key, ttl)
        redis.call('PEXPIRE', key .. ':limit', ttl)
      end
      extended[i] = 1
    end
  end
end
return extended

-- Extend many: compare-and-pexpire on every key, one ttl for all. Never re-creates a
-- missing key. KEYS[i] lock key; ARGV[1] ttl ms, ARGV[i + 1] the owner KEYS[i] must
-- hold. Returns one flag per key, in order: 1 extended, 0 not ours.
local extended = {}
for i, key in ipairs(KEYS) do
  -- `pcall`: shared holders' sorted set (see `node::modes`) is not ours; any other
  -- type's error is the answer.
  local held = redis.pcall('GET', key)
  if held == ARGV[i + 1] then
    redis.call('PEXPIRE', key, ARGV[1])
    extended[i] = 1
  elseif held and held.err and redis.call('TYPE', key)['ok'] ~= 'zset' then
    return held
  else
    extended[i] = 0
  end
end
return extended

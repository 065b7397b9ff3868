-- Extend: compare-and-pexpire. Never re-creates a missing key: a lost lease stays lost.
-- KEYS[1] lock key; ARGV[1] owner, ARGV[2] ttl ms. Returns 1 when extended, 0 otherwise.
-- `pcall`: shared holders' sorted set (see `node::modes`) is not ours; any other
-- type's error is the answer.
local held = redis.pcall('GET', KEYS[1])
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if held and held.err and redis.call('TYPE', KEYS[1])['ok'] ~= 'zset' then
  return held
end
return 0

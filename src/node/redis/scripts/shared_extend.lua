-- Extend a shared holder (see `node::modes`): its expiry becomes now + ttl if it is
-- still live; an expired or missing holder stays lost.
-- KEYS[1] lock key, KEYS[2] the holders' limit (see `shared_acquire.lua`), which lives
-- as long as the set; ARGV[1] owner, ARGV[2] ttl ms. Returns 1 when extended, 0 otherwise.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'zset' then
  return 0
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) <= now then
  return 0
end
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[1])
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1

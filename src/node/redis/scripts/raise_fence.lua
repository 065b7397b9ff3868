-- Raise the fence counter to at least ARGV[1] (the token the quorum agreed on).
-- KEYS[1] fence counter; ARGV[1] token, ARGV[2] fence ttl ms. Returns 1 when raised.
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if cur < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0

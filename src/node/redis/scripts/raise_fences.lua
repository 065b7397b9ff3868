-- Raise each member's fence counter to at least its token (as raise_fence.lua does one).
-- KEYS[i] member i's fence counter; ARGV[1] fence ttl ms, ARGV[i + 1] member i's token.
-- Returns the number of counters raised.
local raised = 0
for i, key in ipairs(KEYS) do
  local cur = tonumber(redis.call('GET', key) or '0')
  if cur < tonumber(ARGV[i + 1]) then
    redis.call('SET', key, ARGV[i + 1], 'PX', ARGV[1])
    raised = raised + 1
  end
end
return raised

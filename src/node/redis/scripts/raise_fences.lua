-- Raise each fence counter to at least its token (the token the quorum agreed on), after
-- `fence_rule.lua`, whose check of a counter's type this shares.
-- KEYS[i] a fence counter; ARGV[1] fence ttl ms, ARGV[i + 1] KEYS[i]'s token.
-- Returns the number of counters raised.
local raised = 0
for i, key in ipairs(KEYS) do
  local ok, n = counter(key)
  if not ok then
    return n
  end
  if (n or 0) < tonumber(ARGV[i + 1]) then
    redis.call('SET', key, ARGV[i + 1], 'PX', ARGV[1])
    raised = raised + 1
  end
end
return raised

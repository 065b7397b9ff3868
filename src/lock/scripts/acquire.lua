-- Acquire: SET NX PX and, on success, bump the fence counter in the same atomic step.
-- KEYS[1] lock key, KEYS[2] fence counter; ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] fence ttl ms.
-- Returns {1, fence} when acquired, {0, pttl} when held by someone else.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence
  if redis.call('EXISTS', KEYS[2]) == 1 then
    fence = redis.call('INCR', KEYS[2])
  else
    -- A missing counter (first use, expired, node restarted empty) starts from the
    -- server clock, ms * 2^10, so it lands above every token issued before (see fencing.rs).
    -- The value stays below 2^53: exact in Lua's doubles and in JavaScript.
    local t = redis.call('TIME')
    fence = (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) * 1024
    redis.call('SET', KEYS[2], string.format('%.0f', fence))
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return {1, fence}
end
return {0, redis.call('PTTL', KEYS[1])}

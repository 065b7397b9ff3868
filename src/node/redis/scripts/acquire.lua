-- Acquire with a fence counter floored by the acquiring client's clock (see `fencing`).
-- KEYS[1] lock key, KEYS[2] fence counter (same hash tag).
-- ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] fence ttl ms,
-- ARGV[4] floor: client clock ms * 2^10 as a decimal string,
-- ARGV[5] '1' to apply the floor only when the counter is missing (test hook).
-- Returns {1, token} when granted, {0, pttl} when someone else holds the key.

-- The counter is read and checked before anything is written: a counter of the wrong
-- type fails every attempt with the server's error and leaves no lock key behind.
local cur = redis.call('GET', KEYS[2])
local n = cur and tonumber(cur)
if cur and not n then
  return redis.error_reply('ERR fence counter ' .. KEYS[2] .. ' is not an integer')
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  -- Our own key: an earlier send of this very call landed before its connection broke
  -- and this is the resend. Same grant, with this round's counter; the counter write
  -- below also lets a pipelined WAIT cover the earlier SET (it precedes it).
  if redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return {0, redis.call('PTTL', KEYS[1])}
  end
end
local token
-- Tokens stay below 2^53, so tonumber is exact; the +1 itself is done by INCR, and the
-- floor is stored as the caller's string, so no large number is ever formatted by Lua.
if n and (ARGV[5] == '1' or n + 1 >= tonumber(ARGV[4])) then
  token = redis.call('INCR', KEYS[2])
else
  redis.call('SET', KEYS[2], ARGV[4])
  token = ARGV[4]
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return {1, token}

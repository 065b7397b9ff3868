-- The fence counter's rule (see `fencing`): a grant's token is max(counter + 1, floor),
-- the floor being the acquiring client's clock ms * 2^10. The one place of the rule:
-- every acquisition's script opens with it (the acquire script, for one resource, a
-- set or shared holders; the fence script `fence.lua`, pipelined behind a plain SET NX),
-- and `raise_fences.lua` checks counters with it.

-- The counter at `key`, checked before a grant is kept: a counter of the wrong type (a
-- string that is no integer, or another type, which GET refuses: pcall, so that the
-- refusal does not end the script) fails the attempt with the server's error.
local function counter(key)
  local cur = redis.pcall('GET', key)
  -- `cur.err` is nil on a string (strings index the string library); globals such as
  -- `type` or `math` cost more in Redis's sandbox than the rest of the check.
  if cur and cur.err then
    return false, cur
  end
  local n = cur and tonumber(cur)
  if cur and not (n and n >= 0 and n % 1 == 0) then
    return false, redis.error_reply('ERR fence counter ' .. key .. ' is not an integer')
  end
  return true, n
end

-- The next token from the counter `n` (nil: missing), written back with the fence ttl.
-- Tokens stay below 2^53, so tonumber is exact; the +1 itself is done by INCR, and the
-- floor is stored as the caller's string, so no large number is ever formatted by Lua.
-- At the floor (the usual case: the last grant was more than a millisecond ago) one SET
-- writes the counter and its ttl. `seed_only`: the floor applies only to a missing
-- counter (the unsafe rule before the floor, a test hook).
local function next_token(key, n, floor, ttl, seed_only)
  if n and (seed_only or n + 1 >= tonumber(floor)) then
    local token = redis.call('INCR', key)
    redis.call('PEXPIRE', key, ttl)
    return token
  end
  redis.call('SET', key, floor, 'PX', ttl)
  return floor
end

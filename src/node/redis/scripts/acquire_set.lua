-- Acquire a set of resources, all or nothing, each member's fence counter floored by
-- the acquiring client's clock as in acquire.lua (see `fencing`).
-- KEYS[2i-1] member i's lock key, KEYS[2i] its fence counter (same hash tag; the members'
-- tags differ, so a standalone or Sentinel-managed server runs it, never a cluster).
-- ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] fence ttl ms,
-- ARGV[4] floor: client clock ms * 2^10 as a decimal string,
-- ARGV[5] '1' to apply the floor only when a counter is missing (test hook),
-- ARGV[6] '1' to maintain the fence counters (else every token is 0).
-- Returns {1, token_1, ..., token_n} when every member was granted, or
-- {0, i, pttl} when someone else holds a member: i the first such member, pttl the
-- longest remaining ttl among them; nothing is written then.

local n = #KEYS / 2
local fencing = ARGV[6] == '1'
-- Every member is checked before anything is written: a set is granted whole or not
-- at all, and a counter of the wrong type fails the call with nothing written.
local counters = {}
local first, longest
for i = 1, n do
  if fencing then
    local cur = redis.call('GET', KEYS[2 * i])
    local c = cur and tonumber(cur)
    if cur and not c then
      return redis.error_reply('ERR fence counter ' .. KEYS[2 * i] .. ' is not an integer')
    end
    counters[i] = c or false
  end
  -- `pcall`: shared holders' sorted set (see `node::modes`) reads as another holder;
  -- any other type's error is the answer.
  local holder = redis.pcall('GET', KEYS[2 * i - 1])
  if holder and holder.err and redis.call('TYPE', KEYS[2 * i - 1])['ok'] ~= 'zset' then
    return holder
  end
  -- Our own value: an earlier send of this very call landed before its connection
  -- broke and this is the resend (as in acquire.lua): the same grant.
  if holder and holder ~= ARGV[1] then
    local pttl = redis.call('PTTL', KEYS[2 * i - 1])
    first = first or i
    if not longest or pttl > longest then
      longest = pttl
    end
  end
end
if first then
  return {0, first, longest}
end
local reply = {1}
for i = 1, n do
  redis.call('SET', KEYS[2 * i - 1], ARGV[1], 'PX', ARGV[2])
  if fencing then
    local c = counters[i]
    -- As acquire.lua: INCR does the +1, and the floor is stored as the caller's string.
    if c and (ARGV[5] == '1' or c + 1 >= tonumber(ARGV[4])) then
      reply[i + 1] = redis.call('INCR', KEYS[2 * i])
    else
      redis.call('SET', KEYS[2 * i], ARGV[4])
      reply[i + 1] = ARGV[4]
    end
    redis.call('PEXPIRE', KEYS[2 * i], ARGV[3])
  else
    reply[i + 1] = 0
  end
end
return reply

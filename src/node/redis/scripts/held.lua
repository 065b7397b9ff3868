-- The prelude of every script that compares a lock key with an owner value.
-- `held(key)`: what the lock key holds: its string, false when there is no key, or
-- SHARED when shared holders keep their sorted set there (owner -> expiry, see
-- `node::modes`), which GET refuses and which is nobody's string. GET's refusal of any
-- other type comes back as the error table itself (`.err` set), for the script to
-- answer with (`if h and h.err then return h end`; `.err` is nil on a string, whose
-- fields are the string library's). Through `pcall`, so that the refusal does not end
-- the script before it can tell the types apart. SHARED is a string no lock key holds
-- (owner values are hex, reservations start with '~'): a constant, nothing allocated.
local SHARED = ' shared'
local function held(key)
  local value = redis.pcall('GET', key)
  if value and value.err and redis.call('TYPE', key)['ok'] == 'zset' then
    return SHARED
  end
  return value
end

-- The fence script: the next token of a resource's counter (`fence_rule.lua` precedes
-- this), pipelined behind the lock's own `SET NX PX` and an `EXISTS` of its wait queue
-- by a fenced caller that does not wait (`call::Acquire::Pipelined`): plain commands
-- cost Redis far less than the same commands inside a script. It runs whether or not
-- the SET took the key; a refused caller's token only moves the counter up, which every
-- later token is above anyway.
-- KEYS[1] fence counter; ARGV[1] floor (decimal string), ARGV[2] fence ttl ms, left out
-- when it is the default (one hour, `LockOptions::fence_ttl`; Redis charges every argument).
-- Returns the token.
local ok, n = counter(KEYS[1])
if not ok then
  return n
end
return next_token(KEYS[1], n, ARGV[1], ARGV[2] or '3600000', false)

-- Release: compare-and-delete, then wake the waiters listening on the resource's channel.
-- KEYS[1] lock key; ARGV[1] owner, ARGV[2] wake-up channel. Returns 1 when deleted, 0 otherwise.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], '')
  return 1
end
return 0

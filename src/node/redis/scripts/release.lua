-- Release: compare-and-delete, then wake the waiters listening on the resource's channel.
-- KEYS[1] lock key; ARGV[1] owner, ARGV[2] wake-up channel, ARGV[3] "1" to publish on the
-- sharded channel (SPUBLISH, Redis Cluster >= 7), else PUBLISH.
-- An empty channel wakes no one (the cleanup of a failed attempt: waking every waiter
-- there would only make them retry in lockstep and split the votes again).
-- Returns 1 when deleted, 0 otherwise.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if ARGV[2] == '' then
    return 1
  elseif ARGV[3] == '1' then
    redis.call('SPUBLISH', ARGV[2], '')
  else
    redis.call('PUBLISH', ARGV[2], '')
  end
  return 1
end
return 0

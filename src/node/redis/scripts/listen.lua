-- Marks a resource's wait queue as listened to (`Node::listen_for_release`): its
-- holder's release then publishes on the resource's own channel (see `hand_off`).
-- The mark is the queue's member '*', scored +inf, after every waiter; the queue lives
-- ARGV[1] ms more, as a refused waiter's attempt keeps it alive.
-- KEYS[1] queue; ARGV[1] queue ttl ms. Returns 1.
redis.call('ZADD', KEYS[1], '+inf', '*')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1

-- Shared prelude of the acquire and release scripts (the wait queue, see `Node::wait_queue`).
-- Hands a free lock to the queue's next waiter that listens: takes waiters off the head
-- of the queue (a sorted set of waiter ids, scored by ticket) until one is subscribed to
-- its own channel (`prefix:id`), reserves the lock for it ('~id:ticket', for `hold` ms)
-- and wakes it alone. A waiter nobody listens for (its process died, its subscription is down) is
-- skipped: a live one joins again, at its old place, on its next attempt.
-- The queue's last member may be the listeners' mark ('*', scored +inf, see
-- `Node::listen_for_release`): waiters that listen on the resource's own channel (for a
-- set of resources) and retry when woken. Reached, it is taken off and they are woken
-- all at once; a listener still refused marks the queue again.
-- Returns 'reserved', 'me' when the head is `me` (taken off the queue, nothing written),
-- or 'none' when no waiter listens (the queue is gone; nothing written).
-- Publishes on `channel` (SPUBLISH when `sharded` is '1') and returns how many heard.
-- Through `redis.pcall`: a user refused the channel (NOPERM) must not stop the script
-- half-way with the lock key still set; a refused wake-up is heard by nobody, and the
-- waiters find the lock free by polling.
local function publish(channel, sharded)
  local heard
  if sharded == '1' then
    heard = redis.pcall('SPUBLISH', channel, '')
  else
    heard = redis.pcall('PUBLISH', channel, '')
  end
  if type(heard) ~= 'number' then
    return 0
  end
  return heard
end

local function hand_off(lock, queue, prefix, sharded, hold, me)
  while true do
    local top = redis.call('ZPOPMIN', queue)
    local head = top[1]
    if not head then
      return 'none'
    end
    if head == me then
      return 'me'
    end
    if head == '*' then
      publish(prefix, sharded)
      return 'none'
    end
    if publish(prefix .. ':' .. head, sharded) > 0 then
      redis.call('SET', lock, '~' .. head .. ':' .. top[2], 'PX', hold)
      return 'reserved'
    end
  end
end

-- Whether a reservation ('~id:ticket') is for waiter `id`.
local function reserved_for(value, id)
  return id ~= '' and value and string.sub(value, 1, #id + 2) == '~' .. id .. ':'
end

-- Whether waiter (t1, id1) comes before waiter (t2, id2): the queue's own order.
local function before(t1, id1, t2, id2)
  local a, b = tonumber(t1), tonumber(t2)
  return a < b or (a == b and id1 < id2)
end

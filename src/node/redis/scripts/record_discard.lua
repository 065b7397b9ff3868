-- Delete a pending marker of the given token; completed records and other markers stay.
-- KEYS[1] record key; ARGV[1] token. Returns 1 when deleted, 0 otherwise.
if redis.call('HGET', KEYS[1], 'state') == 'pending'
    and redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0

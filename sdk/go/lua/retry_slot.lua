-- retry_slot.lua: take one of the N concurrent retry slots of a task type.
--
-- KEYS[1]  <prefix>:retrying:<task_type>   ZSET  task_id -> slot expiry (ms)
-- ARGV[1]  task_id of the retry about to run
-- ARGV[2]  the most retries of this task type that may run at once (default 5)
-- ARGV[3]  how long the slot is held if never released (ms): the attempt's timeout
--
-- Slots of attempts that never released them (their worker died) expire.
-- Returns 1 when the retry may run now (release with ZREM KEYS[1] task_id when
-- it ends), 0 when all slots are taken: then reschedule it on the backoff tier.

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
    redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[1])
    return 1
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[1])
return 1

-- cancel.lua: cancel a task by task_id.
--
-- KEYS[1]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms)
-- KEYS[2]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> stored entry
-- KEYS[3]  <prefix>:{<queue>}:cancelled      ZSET  task_id -> cancel time (ms)
-- ARGV[1]  task_id
-- ARGV[2]  now, ms since the Unix epoch
-- ARGV[3]  how long a cancel mark is kept (ms); older marks are dropped here
--
-- A task still delayed is removed. Otherwise the task_id is marked cancelled:
-- a consumer that receives it acknowledges it without running it and removes
-- the mark (ZREM KEYS[3] task_id). Marks of ids no consumer ever sees expire.
-- Returns "removed", "marked", or "already" when it was marked before.

redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[3]))
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
    redis.call('HDEL', KEYS[2], ARGV[1])
    return 'removed'
end
if redis.call('ZADD', KEYS[3], 'NX', ARGV[2], ARGV[1]) == 1 then return 'marked' end
return 'already'

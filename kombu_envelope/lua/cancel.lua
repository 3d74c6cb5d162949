-- cancel.lua: cancel a task by task_id.
--
-- KEYS[1]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms)
-- KEYS[2]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> stored entry
-- KEYS[3]  <prefix>:{<queue>}:cancelled      HASH  task_id -> cancel time
-- ARGV[1]  task_id
-- ARGV[2]  cancel time, RFC 3339
--
-- A task still delayed is removed. Otherwise the task_id is marked cancelled:
-- a consumer that receives it acknowledges it without running it and deletes
-- the mark (HDEL KEYS[3] task_id).
-- Returns "removed", "marked", or "already" when it was marked before.

if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
    redis.call('HDEL', KEYS[2], ARGV[1])
    return 'removed'
end
if redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[2]) == 1 then return 'marked' end
return 'already'

-- cancel.lua: remove a cancelled task from the delayed set of one queue.
--
-- KEYS[1]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms)
-- KEYS[2]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> stored entry
-- ARGV[1]  task_id
--
-- The caller marks the task_id in <prefix>:cancelled first (docs/protocol.md,
-- section 10): the mark catches the task wherever it is when it reaches a
-- consumer; this script makes sure it is not waiting in this queue's delayed set.
-- Returns "removed" when it was delayed here, "absent" otherwise.

if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
    redis.call('HDEL', KEYS[2], ARGV[1])
    return 'removed'
end
return 'absent'

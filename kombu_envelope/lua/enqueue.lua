-- enqueue.lua: add a due task to its stream, replacing any delayed copy.
--
-- KEYS[1]  the task stream of the task's priority bucket
-- KEYS[2]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms)
-- KEYS[3]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> stored entry
-- ARGV[1]  task_id
-- ARGV[2]  enc of the body
-- ARGV[3]  body: the encoded Envelope
--
-- Publishing a task_id that is still waiting in the delayed set (scheduled
-- earlier, now published to run at once) must not deliver it twice: the
-- delayed copy is removed in the same step.
-- Returns the new stream entry id.

redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return redis.call('XADD', KEYS[1], '*', 'v', '1', 'enc', ARGV[2], 'body', ARGV[3])

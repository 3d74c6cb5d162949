-- promote.lua: move due tasks of one queue from its delayed set to its streams.
--
-- KEYS[1]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms)
-- KEYS[2]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> "<bucket>\n<enc>\n<body>"
-- KEYS[3]  <prefix>:{<queue>}:high           task stream
-- KEYS[4]  <prefix>:{<queue>}:normal         task stream
-- KEYS[5]  <prefix>:{<queue>}:low            task stream
-- ARGV[1]  now, integer milliseconds since the Unix epoch
-- ARGV[2]  the most tasks to move in this call
--
-- Runs atomically: however many promoters call it at once, each due task is
-- added to a stream exactly once, and a promoter that dies between calls
-- leaves every task either still delayed or already in its stream.
-- Returns {moved, next_due}: how many tasks were moved and the due time of the
-- earliest task still delayed (-1 when none is left).

local streams = {high = KEYS[3], normal = KEYS[4], low = KEYS[5]}
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local moved = 0
for _, id in ipairs(ids) do
    local stored = redis.call('HGET', KEYS[2], id)
    if stored then
        local bucket, enc, body = string.match(stored, '^([^\n]*)\n([^\n]*)\n(.*)$')
        redis.call('XADD', streams[bucket] or KEYS[4], '*', 'v', '1', 'enc', enc, 'body', body)
        redis.call('HDEL', KEYS[2], id)
        moved = moved + 1
    end
    redis.call('ZREM', KEYS[1], id)
end
local following = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local next_due = -1
if following[2] then next_due = tonumber(following[2]) end
return {moved, next_due}

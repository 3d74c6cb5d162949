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
-- A due task with an ordering_key joins its key's order (docs/protocol.md, section 20):
-- to its stream when it is the key's head, else to the key's waiting hash. Before
-- that, the keys listed in <prefix>:{<queue>}:order-advanced (their head was settled)
-- and those of expired members of <prefix>:{<queue>}:order-held release their next
-- task from the waiting hash to its stream.
-- Returns {moved, next_due}: how many tasks were moved (released ones included) and the
-- due time of the earliest task still delayed or key still held (-1 when none is left;
-- now while keys are left to release).

-- Ordering keys (docs/protocol.md, section 20): the ordering_key and task_id of a plain
-- JSON body, or nil.
local function ordering_key(enc, body)
    if enc ~= 'json' or not string.find(body, '"ordering_key"', 1, true) then return nil end
    local ok, envelope = pcall(cjson.decode, body)
    if ok and type(envelope) == 'table' and type(envelope.ordering_key) == 'string' then
        return envelope.ordering_key, envelope.task_id
    end
    return nil
end

-- Adds a task to its stream, or, keyed and not its key's head, to the key's waiting
-- hash. Returns the entry id, or 'waiting'.
local function join(stream, enc, body)
    local key, task_id = ordering_key(enc, body)
    if key then
        local base, bucket = string.match(stream, '^(.*):([^:]+)$')
        local order = base .. ':order:' .. key
        local head = redis.call('LINDEX', order, 0)
        if not head then
            redis.call('RPUSH', order, task_id)
        elseif head ~= task_id then
            local stored = bucket .. '\n' .. enc .. '\n' .. body
            if redis.call('HSET', base .. ':order-waiting:' .. key, task_id, stored) == 1 then
                redis.call('RPUSH', order, task_id)
            end
            return 'waiting'
        end
    end
    return redis.call('XADD', stream, '*', 'v', '1', 'enc', enc, 'body', body)
end

local streams = {high = KEYS[3], normal = KEYS[4], low = KEYS[5]}
local now, batch = tonumber(ARGV[1]), tonumber(ARGV[2])
local base = string.match(KEYS[1], '^(.*):[^:]+$')
local moved = 0

-- The head of `key` to its stream when it waits in the key's waiting hash.
local function release(key)
    local head = redis.call('LINDEX', base .. ':order:' .. key, 0)
    if not head then return end
    local waiting = base .. ':order-waiting:' .. key
    local stored = redis.call('HGET', waiting, head)
    if not stored then return end  -- in a stream already, or delayed
    local bucket, enc, body = string.match(stored, '^([^\n]*)\n([^\n]*)\n(.*)$')
    redis.call('XADD', streams[bucket] or KEYS[4], '*', 'v', '1', 'enc', enc, 'body', body)
    redis.call('HDEL', waiting, head)
    moved = moved + 1
end

local advanced = base .. ':order-advanced'
for _ = 1, batch do
    local key = redis.call('LPOP', advanced)
    if not key then break end
    release(key)
end
-- Keys held by runs acknowledged early whose holder stopped renewing: the key moves on
-- when the entry is gone, and is left to the entry's next run when it is still there.
local held = base .. ':order-held'
for _, member in ipairs(redis.call('ZRANGEBYSCORE', held, '-inf', now, 'LIMIT', 0, batch)) do
    redis.call('ZREM', held, member)
    local key, task_id, stream, id = string.match(member, '^([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)$')
    if key and #redis.call('XRANGE', stream, id, id) == 0 then
        local order = base .. ':order:' .. key
        if redis.call('LINDEX', order, 0) == task_id then redis.call('LPOP', order) end
        release(key)
    end
end

local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, batch)
for _, id in ipairs(ids) do
    local stored = redis.call('HGET', KEYS[2], id)
    if stored then
        local bucket, enc, body = string.match(stored, '^([^\n]*)\n([^\n]*)\n(.*)$')
        join(streams[bucket] or KEYS[4], enc, body)
        redis.call('HDEL', KEYS[2], id)
        moved = moved + 1
    end
    redis.call('ZREM', KEYS[1], id)
end
local next_due = -1
local function sooner(due)
    if due and (next_due < 0 or due < next_due) then next_due = due end
end
sooner(tonumber(redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]))
sooner(tonumber(redis.call('ZRANGE', held, 0, 0, 'WITHSCORES')[2]))
if redis.call('EXISTS', advanced) == 1 then sooner(now) end
return {moved, next_due}

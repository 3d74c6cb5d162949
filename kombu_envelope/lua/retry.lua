-- retry.lua: replace a pending entry by its next attempt, now or after a delay.
--
-- KEYS[1]  the stream holding the failed attempt
-- KEYS[2]  the stream the next attempt goes to when due now (its priority bucket)
-- KEYS[3]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms)
-- KEYS[4]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> "<bucket>\n<enc>\n<body>"
-- ARGV[1]  consumer group
-- ARGV[2]  entry id of the failed attempt
-- ARGV[3]  task_id
-- ARGV[4]  due time of the next attempt, ms since the Unix epoch (0: now)
-- ARGV[5]  bucket of the next attempt: "high", "normal" or "low"
-- ARGV[6]  enc of the new body
-- ARGV[7]  new body: the next attempt (retry_count + 1 for a retry, unchanged for a
--          deferral; schedule_time = now + delay, absent when the delay is 0)
-- ARGV[8]  pub/sub channel that wakes promoters (<prefix>:wakeup)
-- KEYS[5]  optional: the task record (section 14); ARGV[9] is then its spec. The
--          caller sets its state (retrying, or scheduled for a deferral); queued when due now
--
-- The next attempt is stored and the failed one acknowledged and deleted in
-- one step, so a crash never loses the task nor runs it twice. A concurrency
-- slot the failed attempt held is freed. The caller
-- adds the queue to <prefix>:queues when the attempt is delayed.
-- Returns 1, or false when the entry was no longer pending.

-- The task record (docs/protocol.md, section 14): spec {"ttl_ms", "fields"} and the
-- fields this script adds itself.
local function write_record(key, spec, extra, ttl_name)
    local record = cjson.decode(spec)
    local args = {}
    for field, value in pairs(record.fields or {}) do
        args[#args + 1] = field
        args[#args + 1] = tostring(value)
    end
    for i = 1, #extra do args[#args + 1] = extra[i] end
    if #args > 0 then redis.call('HSET', key, unpack(args)) end
    local ttl = tonumber(record[ttl_name or 'ttl_ms']) or 0
    if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
end

-- Frees the concurrency slot the entry held (docs/protocol.md, section 19): its task
-- type is field "t", else the task_type of a plain JSON body.
local function free_slot(stream, id, fields)
    local t, enc, body
    for i = 1, #fields, 2 do
        local name = fields[i]
        if name == 't' then t = fields[i + 1] elseif name == 'enc' then enc = fields[i + 1]
        elseif name == 'body' then body = fields[i + 1] end
    end
    if not t and enc == 'json' and body then
        local ok, envelope = pcall(cjson.decode, body)
        if ok and type(envelope) == 'table' and type(envelope.task_type) == 'string' then
            t = envelope.task_type
        end
    end
    if t then
        -- Called before the script writes anything: while Redis Cluster migrates the
        -- slot, a running key not on this node may abort the script (a redirect the
        -- caller follows), which then has done nothing.
        local base = string.match(stream, '^(.*):[^:]+$')
        if redis.pcall('ZREM', base .. ':running:' .. t, stream .. ' ' .. id) == 1 then
            -- Wakes consumers waiting for a slot, if any wait (section 19).
            redis.pcall('XADD', base .. ':slot-freed', 'MAXLEN', '1', 'NOMKSTREAM', '*', 't', t)
        end
    end
end

local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then return false end
local found = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
if found[1] then free_slot(KEYS[1], ARGV[2], found[1][2]) end
local due = tonumber(ARGV[4])
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if due <= now_ms then
    redis.call('XADD', KEYS[2], '*', 'v', '1', 'enc', ARGV[6], 'body', ARGV[7])
else
    local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
    redis.call('ZADD', KEYS[3], due, ARGV[3])
    redis.call('HSET', KEYS[4], ARGV[3], ARGV[5] .. '\n' .. ARGV[6] .. '\n' .. ARGV[7])
    if first[2] == nil or due < tonumber(first[2]) then
        redis.call('PUBLISH', ARGV[8], ARGV[4])
    end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if KEYS[5] then
    write_record(KEYS[5], ARGV[9], due <= now_ms and {'state', 'queued'} or {})
end
return 1

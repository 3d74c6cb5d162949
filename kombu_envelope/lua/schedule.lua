-- schedule.lua: store a task in its queue's delayed set until it is due.
--
-- KEYS[1]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms since the Unix epoch)
-- KEYS[2]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> "<bucket>\n<enc>\n<body>"
-- KEYS[3]  <prefix>:{<queue>}:published:<task_id>  STRING "<token> scheduled"
-- ARGV[1]  task_id
-- ARGV[2]  due time, integer milliseconds since the Unix epoch
-- ARGV[3]  bucket the task goes to when due: "high", "normal" or "low"
-- ARGV[4]  enc of the body: "json" or "json+gzip"
-- ARGV[5]  body: the encoded Envelope
-- ARGV[6]  pub/sub channel that wakes promoters (<prefix>:wakeup)
-- ARGV[7]  publish token, the same for every try of one publish
-- ARGV[8]  how long KEYS[3] is kept (ms)
-- KEYS[4]  optional: the task record (section 14); ARGV[9] is then its spec
--
-- Scheduling a task_id that is already delayed replaces it (a repeated publish
-- stays one task). Publishes the due time on ARGV[6] when this task became the
-- earliest of its queue, so sleeping promoters wake up in time.
-- A try repeated with the token of the last publish of this task_id (its reply
-- was lost with the connection) changes nothing, even if the task was promoted
-- meanwhile, and answers 0.
-- Returns 1 when the task is new in the delayed set, 0 when it replaced one.
-- Nothing here ever expires: delayed tasks carry no TTL.

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

if redis.call('GET', KEYS[3]) == ARGV[7] .. ' scheduled' then return 0 end
redis.call('SET', KEYS[3], ARGV[7] .. ' scheduled', 'PX', tonumber(ARGV[8]))
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local added = redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. '\n' .. ARGV[4] .. '\n' .. ARGV[5])
if first[2] == nil or tonumber(ARGV[2]) < tonumber(first[2]) then
    redis.call('PUBLISH', ARGV[6], ARGV[2])
end
if KEYS[4] then write_record(KEYS[4], ARGV[9], {'state', 'scheduled'}) end
return added

-- periodic.lua: claim one occurrence of a periodic task and schedule it, once.
--
-- KEYS[1]  <prefix>:{<queue>}:periodic       HASH  entry name -> next occurrence (ms)
-- KEYS[2]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms)
-- KEYS[3]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> "<bucket>\n<enc>\n<body>"
-- ARGV[1]  entry name
-- ARGV[2]  the occurrence being claimed (ms): must equal the stored next occurrence
-- ARGV[3]  the occurrence after it (ms), stored as the new next occurrence
-- ARGV[4]  task_id of this occurrence's task
-- ARGV[5]  bucket: "high", "normal" or "low"
-- ARGV[6]  enc of the body
-- ARGV[7]  body: the Envelope of this occurrence
-- ARGV[8]  pub/sub channel that wakes promoters (<prefix>:wakeup)
-- KEYS[4]  optional: the task record of the occurrence (section 14); ARGV[9] is then
--          its spec, whose fields include the occurrence's due_at
--
-- Advancing the entry and scheduling its task happen in one step: however
-- many schedulers race, each occurrence is published exactly once, and a
-- scheduler that dies loses nothing (the occurrence stays claimable).
-- Returns 1 when this caller claimed the occurrence, 0 when another did (which then
-- writes no record).

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

if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[4])
redis.call('HSET', KEYS[3], ARGV[4], ARGV[5] .. '\n' .. ARGV[6] .. '\n' .. ARGV[7])
if first[2] == nil or tonumber(ARGV[2]) < tonumber(first[2]) then
    redis.call('PUBLISH', ARGV[8], ARGV[2])
end
if KEYS[4] then write_record(KEYS[4], ARGV[9], {'state', 'scheduled'}) end
return 1

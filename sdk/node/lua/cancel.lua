-- cancel.lua: remove a cancelled task from the delayed set of one queue.
--
-- KEYS[1]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms)
-- KEYS[2]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> stored entry
-- ARGV[1]  task_id
-- KEYS[3]  optional: the task record (section 14); ARGV[2] is then its spec. It is
--          written (state cancelled) only when the task was removed
--
-- The caller marks the task_id in <prefix>:cancelled first (docs/protocol.md,
-- section 10): the mark catches the task wherever it is when it reaches a
-- consumer; this script makes sure it is not waiting in this queue's delayed set.
-- Returns "removed" when it was delayed here, "absent" otherwise.

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

if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
    redis.call('HDEL', KEYS[2], ARGV[1])
    if KEYS[3] then
        write_record(KEYS[3], ARGV[2], {'state', 'cancelled', 'reason', 'cancelled'})
    end
    return 'removed'
end
return 'absent'

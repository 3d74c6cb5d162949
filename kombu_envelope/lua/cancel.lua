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

-- A delayed task that is the head of its ordering key (a retry waiting for its delay)
-- moves its key on (docs/protocol.md, section 20). Read before anything is written: while
-- Redis Cluster migrates the slot, an order key not on this node aborts the script.
local stored = redis.call('HGET', KEYS[2], ARGV[1])
local base = string.match(KEYS[1], '^(.*):[^:]+$')
local key, order
if stored then
    local enc, body = string.match(stored, '^[^\n]*\n([^\n]*)\n(.*)$')
    if enc == 'json' and string.find(body, '"ordering_key"', 1, true) then
        local ok, envelope = pcall(cjson.decode, body)
        if ok and type(envelope) == 'table' and type(envelope.ordering_key) == 'string' then
            key = envelope.ordering_key
            order = base .. ':order:' .. key
            if redis.call('LINDEX', order, 0) ~= ARGV[1] then key = nil end
        end
    end
end

if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
    redis.call('HDEL', KEYS[2], ARGV[1])
    if key then
        redis.call('LPOP', order)
        redis.call('RPUSH', base .. ':order-advanced', key)
        redis.call('PUBLISH', string.match(base, '^(.*):{[^{}]*}$') .. ':wakeup', '0')
    end
    if KEYS[3] then
        write_record(KEYS[3], ARGV[2], {'state', 'cancelled', 'reason', 'cancelled'})
    end
    return 'removed'
end
return 'absent'

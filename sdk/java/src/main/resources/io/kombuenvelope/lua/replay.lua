-- replay.lua: publish a dead-lettered task again, once, and keep a record of it.
--
-- KEYS[1]  <prefix>:{<queue>}:dead       dead-letter stream
-- KEYS[2]  the task stream to publish to (the priority bucket of the new Envelope)
-- KEYS[3]  <prefix>:{<queue>}:replayed   stream of replay records
-- ARGV[1]  id of the dead-letter entry
-- ARGV[2]  enc of the new body
-- ARGV[3]  new body: the validated, possibly edited, Envelope
-- ARGV[4..] field, value pairs added to the replay record (replayed_at, operator, ...)
-- KEYS[4]  optional: the new task's record (section 14); ARGV[4] is then its spec,
--          the field, value pairs start at ARGV[5], and the record gets state queued
--
-- The dead-letter entry is removed and a replay record (the extra fields, the
-- new entry id, then every field of the dead-letter entry) is added in the same
-- step, so two operators replaying the same entry publish it once.
-- A task with an ordering_key joins its key's order (docs/protocol.md, section 20); the
-- replay of the head a key halted for clears the halt.
-- Returns the new stream entry id, "waiting" (its key's turn has not come), or false
-- when the entry was already gone.

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

local found = redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1])
if #found == 0 then return false end
-- A replayed head of a halted key clears the halt and runs again as the head.
local key, task_id = ordering_key(ARGV[2], ARGV[3])
if key then
    local halted = string.match(KEYS[2], '^(.*):[^:]+$') .. ':order-halted'
    if redis.call('HGET', halted, key) == task_id then redis.call('HDEL', halted, key) end
end
local new_id = join(KEYS[2], ARGV[2], ARGV[3])
local record = {'dead_id', ARGV[1], 'new_id', new_id, 'stream', KEYS[2]}
for i = KEYS[4] and 5 or 4, #ARGV do record[#record + 1] = ARGV[i] end
local fields = found[1][2]
for i = 1, #fields do record[#record + 1] = fields[i] end
redis.call('XADD', KEYS[3], '*', unpack(record))
redis.call('XDEL', KEYS[1], ARGV[1])
if KEYS[4] then write_record(KEYS[4], ARGV[4], {'state', 'queued'}) end
return new_id

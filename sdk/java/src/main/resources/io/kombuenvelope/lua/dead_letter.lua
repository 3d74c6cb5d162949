-- dead_letter.lua: move a pending entry to the queue's dead-letter stream.
--
-- KEYS[1]  the stream holding the entry
-- KEYS[2]  the queue's dead-letter stream <prefix>:{<queue>}:dead
-- ARGV[1]  consumer group
-- ARGV[2]  entry id
-- ARGV[3..] field, value pairs describing the failure (dlq, failure_class,
--           reason, dead_at, ...; see docs/protocol.md)
-- KEYS[3]  optional: the task record (section 14); ARGV[3] is then its spec, the
--          field, value pairs start at ARGV[4], and the record gets state dead and dead_id
--
-- The dead-letter entry gets the failure fields followed by every field of
-- the original entry, byte for byte, under the name "raw.<field>". The entry
-- is then acknowledged and deleted. Runs atomically, so an entry is
-- dead-lettered at most once. A concurrency slot the entry held is freed, and a head of
-- an ordering key moves its key on or halts it (section 20).
-- Returns the dead-letter entry id, or false when the entry was not pending.

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


-- Ordering keys (docs/protocol.md, section 20): a dead-lettered head moves its key on, or
-- halts it when the policy of its task type says so. Reads before it writes, and is
-- called before the script writes anything: while Redis Cluster migrates the slot, an
-- order key not on this node aborts the script (a redirect the caller follows).
local function key_dead(stream, fields)
    local enc, body
    for i = 1, #fields, 2 do
        if fields[i] == 'enc' then enc = fields[i + 1] elseif fields[i] == 'body' then body = fields[i + 1] end
    end
    if enc ~= 'json' or not body or not string.find(body, '"ordering_key"', 1, true) then return end
    local ok, envelope = pcall(cjson.decode, body)
    if not (ok and type(envelope) == 'table' and type(envelope.ordering_key) == 'string') then return end
    local base = string.match(stream, '^(.*):[^:]+$')
    local key, task_id = envelope.ordering_key, tostring(envelope.task_id)
    local order = base .. ':order:' .. key
    local head = redis.call('LINDEX', order, 0)
    local policy = redis.call('HGET', base .. ':order-policy', tostring(envelope.task_type))
    if head == task_id and policy == 'halt' then
        redis.call('HSET', base .. ':order-halted', key, task_id)
    elseif redis.call('LREM', order, 1, task_id) == 1 and head == task_id then
        redis.call('RPUSH', base .. ':order-advanced', key)
        redis.call('PUBLISH', string.match(base, '^(.*):{[^{}]*}$') .. ':wakeup', '0')
    end
end

local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then return false end
local found = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
local dead = {}
local first_pair = KEYS[3] and 4 or 3
for i = first_pair, #ARGV do dead[#dead + 1] = ARGV[i] end
if found[1] then
    local fields = found[1][2]
    for i = 1, #fields, 2 do
        dead[#dead + 1] = 'raw.' .. fields[i]
        dead[#dead + 1] = fields[i + 1]
    end
    key_dead(KEYS[1], fields)
    free_slot(KEYS[1], ARGV[2], fields)
end
local id = redis.call('XADD', KEYS[2], '*', unpack(dead))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if KEYS[3] then write_record(KEYS[3], ARGV[3], {'state', 'dead', 'dead_id', id}) end
return id

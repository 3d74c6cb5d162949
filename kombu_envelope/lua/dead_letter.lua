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
-- dead-lettered at most once. A concurrency slot the entry held is freed.
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
        redis.pcall('ZREM', string.match(stream, '^(.*):[^:]+$') .. ':running:' .. t, stream .. ' ' .. id)
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
    free_slot(KEYS[1], ARGV[2], fields)
end
local id = redis.call('XADD', KEYS[2], '*', unpack(dead))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if KEYS[3] then write_record(KEYS[3], ARGV[3], {'state', 'dead', 'dead_id', id}) end
return id

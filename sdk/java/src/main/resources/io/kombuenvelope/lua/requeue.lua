-- requeue.lua: put a pending entry back at the end of a stream, for any consumer.
--
-- KEYS[1]  the stream holding the entry
-- KEYS[2]  the stream to put it in (usually KEYS[1])
-- KEYS[3]  the queue's dead-letter stream <prefix>:{<queue>}:dead
-- ARGV[1]  consumer group
-- ARGV[2]  entry id
-- ARGV[3]  owner the entry must still have, or "" for any owner
-- ARGV[4]  idle time (ms) the entry must have reached, or 0
-- ARGV[5]  1 to count this as a redelivery after a consumer died (field "n"), else 0
-- ARGV[6]  redeliveries after which the entry is dead-lettered instead (0: no limit)
-- ARGV[7]  dead_at timestamp (RFC 3339) for a dead-letter entry
-- ARGV[8..] field, value pairs added to a dead-letter entry (queue, language,
--           host, pid, consumer, ...; see docs/protocol.md section 7)
-- KEYS[4]  optional: the task record (section 14); ARGV[8] is then its spec and the
--          field, value pairs start at ARGV[9]. The record gets state queued (spec
--          ttl_ms), or dead with dead_id, finished_at and error (spec dead_ttl_ms)
--
-- Used for reject(requeue=True), for returning prefetched entries on shutdown
-- and for taking over the entries of a consumer whose liveness key expired.
-- A copy put back by a live consumer (ARGV[5] = 0) counts it in field "r", so
-- its next consumer sees it as redelivered, as AMQP and kombu's redis
-- transport do; a taken-over copy counts in "n".
-- The entry is copied, acknowledged and deleted in one step, so two callers
-- racing over the same entry requeue it once. A concurrency slot the entry held
-- is freed (the copy takes a new one when it is read again).
-- A dead-lettered head of an ordering key moves its key on or halts it (section 20).
-- Returns the new entry id, "dead:<id>" when it was dead-lettered, or false
-- when the entry was no longer pending (with the required owner and idle time).

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

local pending = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', tonumber(ARGV[4]), ARGV[2], ARGV[2], 1)
if #pending == 0 then return false end
if ARGV[3] ~= '' and pending[1][2] ~= ARGV[3] then return false end
local found = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
local fields = found[1] and found[1][2] or {}
local copy = {}
local redeliveries = 0
local requeues = 0
for i = 1, #fields, 2 do
    if fields[i] == 'n' then
        redeliveries = tonumber(fields[i + 1]) or 0
    elseif fields[i] == 'r' then
        requeues = tonumber(fields[i + 1]) or 0
    else
        copy[#copy + 1] = fields[i]
        copy[#copy + 1] = fields[i + 1]
    end
end
if ARGV[5] == '1' then redeliveries = redeliveries + 1 end
local limit = tonumber(ARGV[6])
local dies = found[1] and limit > 0 and redeliveries >= limit
-- Before any write (below).
if dies then key_dead(KEYS[1], fields) end
if found[1] then free_slot(KEYS[1], ARGV[2], fields) end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if #found == 0 then return false end

if dies then
    local dead = {'dlq', '1', 'failure_class', 'redelivery_limit',
        'reason', 'its consumer died ' .. redeliveries .. ' times while holding it',
        'source_stream', KEYS[1], 'source_id', ARGV[2], 'dead_at', ARGV[7],
        'redeliveries', tostring(redeliveries)}
    for i = KEYS[4] and 9 or 8, #ARGV do dead[#dead + 1] = ARGV[i] end
    for i = 1, #fields, 2 do
        dead[#dead + 1] = 'raw.' .. fields[i]
        dead[#dead + 1] = fields[i + 1]
    end
    local dead_id = redis.call('XADD', KEYS[3], '*', unpack(dead))
    if KEYS[4] then
        write_record(KEYS[4], ARGV[8], {'state', 'dead', 'dead_id', dead_id, 'finished_at',
            ARGV[7], 'error', 'redelivery_limit: ' .. dead[6]}, 'dead_ttl_ms')
    end
    return 'dead:' .. dead_id
end
if redeliveries > 0 then
    copy[#copy + 1] = 'n'
    copy[#copy + 1] = tostring(redeliveries)
end
if ARGV[5] ~= '1' then requeues = requeues + 1 end
if requeues > 0 then
    copy[#copy + 1] = 'r'
    copy[#copy + 1] = tostring(requeues)
end
local new_id = redis.call('XADD', KEYS[2], '*', unpack(copy))
if KEYS[4] then write_record(KEYS[4], ARGV[8], {'state', 'queued'}) end
return new_id

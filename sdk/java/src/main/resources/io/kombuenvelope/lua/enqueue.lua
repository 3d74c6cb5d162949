-- enqueue.lua: add a due task to its stream, replacing any delayed copy.
--
-- KEYS[1]  the task stream of the task's priority bucket
-- KEYS[2]  <prefix>:{<queue>}:delayed        ZSET  task_id -> due time (ms)
-- KEYS[3]  <prefix>:{<queue>}:delayed:data   HASH  task_id -> stored entry
-- KEYS[4]  <prefix>:{<queue>}:published:<task_id>  STRING "<token> <entry id>"
-- ARGV[1]  task_id
-- ARGV[2]  enc of the body
-- ARGV[3]  body: the encoded Envelope
-- ARGV[4]  publish token, the same for every try of one publish
-- ARGV[5]  how long KEYS[4] is kept (ms)
-- KEYS[5]  optional: the task record (section 14); ARGV[6] is then its spec
--
-- Publishing a task_id that is still waiting in the delayed set (scheduled
-- earlier, now published to run at once) must not deliver it twice: the
-- delayed copy is removed in the same step.
-- A try repeated with the token of the last publish of this task_id (its reply
-- was lost with the connection) adds nothing and answers the same entry id.
-- A task with an ordering_key (docs/protocol.md, section 20) joins its key's order:
-- it is added to the stream only when it is the key's head; otherwise it waits in the
-- key's waiting hash and the answer is "waiting".
-- Returns the new stream entry id, or "waiting".

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

local last = redis.call('GET', KEYS[4])
if last then
    local token, id = string.match(last, '^(%S+) (%S+)$')
    if token == ARGV[4] then return id end
end
-- Joined first: while Redis Cluster migrates the slot, an order key not on this node
-- aborts the script before anything was written (a redirect the caller follows).
local id = join(KEYS[1], ARGV[2], ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SET', KEYS[4], ARGV[4] .. ' ' .. id, 'PX', tonumber(ARGV[5]))
if KEYS[5] then write_record(KEYS[5], ARGV[6], {'state', 'queued'}) end
return id

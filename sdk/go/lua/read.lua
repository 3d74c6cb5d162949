-- read.lua: take up to COUNT new entries of one consumer group, most urgent stream first,
-- within the task types' limits (docs/protocol.md, section 19).
--
-- KEYS[1..n]  the streams of one queue, in the order they are served
--             (high, normal, low, then Python's non-task "kombu" stream)
-- ARGV[1]     consumer group
-- ARGV[2]     consumer name
-- ARGV[3]     the most entries to take in all
-- ARGV[4]     optional: lease_ms, how long a slot taken now is held without renewal
-- ARGV[5]     optional: what the caller can start now; an entry of a limited type is
--             taken only while fewer entries than that were handed out before it in this
--             call (whatever their types), so none waits behind others holding a slot;
--             ARGV[3] when absent
--
-- Equivalent to XREADGROUP ... STREAMS <key> > on each key in turn, stopping
-- when COUNT entries were taken, so a prefetch limit is never exceeded and a
-- lower bucket is read only when the higher ones are empty. Never blocks.
-- Without ARGV[4] it reads as before limits existed and returns the XREADGROUP
-- reply shape {{key, {{id, {field, value, ...}}, ...}}, ...}.
--
-- With ARGV[4], an entry whose task type has limits in <prefix>:{<queue>}:limits is
-- taken only when the type may start one more attempt now: a free concurrency slot
-- (ZSET <prefix>:{<queue>}:running:<task_type>, member "<stream> <entry id>", score
-- the slot's deadline in ms), a rate token (GCRA, <prefix>:{<queue>}:rate:<task_type>)
-- and a circuit breaker that is not open (HASH <prefix>:{<queue>}:breaker:<task_type>,
-- judged from the succeeded and failed counts workers keep in <prefix>:{<queue>}:stats).
-- Other entries are parked in the same call: claimed by the consumer "parked" and
-- listed in <prefix>:{<queue>}:parked:<task_type>, in order, behind which later entries
-- of that type wait. Parked entries are handed out first, as soon as their type may
-- start. Returns {reply, wait_ms, limited, freed_after}: reply in the shape above; wait_ms
-- the longest the caller may wait before reading again while entries are parked (-1:
-- none are); limited 1 when the queue has limits (then never take entries with a
-- blocking XREADGROUP: wait with XREAD BLOCK and read with this script); freed_after,
-- while entries wait for a free slot, the id after which the stream
-- <prefix>:{<queue>}:slot-freed gets an entry when a slot frees (add it to that XREAD),
-- else ''. That stream exists only while entries wait for a slot.

local PARKED = 'parked'
local POLL_MS = 20
local SCAN_MORE = 1000

local function read_plain()
    local left = tonumber(ARGV[3])
    local reply = {}
    for _, key in ipairs(KEYS) do
        if left <= 0 then break end
        local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS', key, '>')
        if got and got[1] then
            left = left - #got[1][2]
            reply[#reply + 1] = {key, got[1][2]}
        end
    end
    return reply
end

if not ARGV[4] then return read_plain() end

local base = string.match(KEYS[1], '^(.*):[^:]+$')

-- The limit keys are not in KEYS (their names depend on the task types). While Redis
-- Cluster migrates the queue's slot, touching one that is not on this node either fails
-- (then read as without limits: nothing here can tell whether there are any; or, once
-- limits are known, hand out nothing until the slot settles) or aborts the script with
-- a redirect the caller follows: so every key this call may touch is looked at first,
-- before anything is written.
local function here(key)
    local answer = redis.pcall('EXISTS', key)
    return not (type(answer) == 'table' and answer.err)
end
if not here(base .. ':limits') then return {read_plain(), -1, 1, ''} end
local configured = redis.call('HGETALL', base .. ':limits')
if not here(base .. ':parked-types') then
    if #configured == 0 then return {read_plain(), -1, 1, ''} end
    return {{}, POLL_MS, 1, ''}
end
-- Without limits, and with nothing parked (entries parked before the last limit was
-- removed are handed out below), a plain read.
if #configured == 0 and redis.call('EXISTS', base .. ':parked-types') == 0 then
    redis.call('DEL', base .. ':slot-freed')  -- left by entries that waited before
    return {read_plain(), -1, 0, ''}
end

for i = 1, #configured, 2 do
    local t = configured[i]
    for _, suffix in ipairs({':running:', ':rate:', ':parked:', ':breaker:', ':breaker-samples:'}) do
        if not here(base .. suffix .. t) then return {{}, POLL_MS, 1, ''} end
    end
end
if not here(base .. ':stats') or not here(base .. ':slot-freed') then return {{}, POLL_MS, 1, ''} end

local lease_ms = tonumber(ARGV[4])
local left = tonumber(ARGV[3])
local limited_left = tonumber(ARGV[5] or ARGV[3])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

-- limits[t] = {concurrency = n or nil, interval = ms or nil, tolerance = ms}
local limits, names = {}, {}
for i = 1, #configured, 2 do
    local ok, spec = pcall(cjson.decode, configured[i + 1])
    if ok and type(spec) == 'table' then
        local limit = {concurrency = tonumber(spec.concurrency)}
        local rate = tonumber(spec.rate)
        if rate and rate > 0 then
            limit.interval = 1000 / rate
            local burst = spec.smooth == true and 1 or (tonumber(spec.burst) or 1)
            limit.tolerance = (math.max(burst, 1) - 1) * limit.interval
        end
        if type(spec.breaker) == 'table' and tonumber(spec.breaker.failure_ratio) then
            local b = spec.breaker
            limit.breaker = {ratio = tonumber(b.failure_ratio),
                             min_attempts = tonumber(b.min_attempts) or 20,
                             window_ms = (tonumber(b.window_s) or 60) * 1000,
                             cooldown_ms = (tonumber(b.cooldown_s) or 30) * 1000,
                             probes = tonumber(b.probes) or 1}
        end
        limits[configured[i]] = limit
        names[#names + 1] = configured[i]
    end
end

-- The task type of an entry: field "t", else the body's task_type when it is plain
-- JSON (a json+gzip body without "t" cannot be read here and is never limited).
local function task_type(fields)
    local enc, body
    for i = 1, #fields, 2 do
        local name = fields[i]
        if name == 't' then return fields[i + 1] end
        if name == 'enc' then enc = fields[i + 1] elseif name == 'body' then body = fields[i + 1] end
    end
    if enc ~= 'json' or not body then return nil end
    -- A key "task_type" found once is the Envelope's own: read its value without
    -- decoding the body, unless the value holds an escape (then decode, below).
    local _, key_end = string.find(body, '"task_type"', 1, true)
    if key_end and not string.find(body, '"task_type"', key_end + 1, true) then
        local value = string.match(body, '^%s*:%s*"([^"\\]*)"', key_end + 1)
        if value then return value end
    end
    local quoted = false
    for _, name in ipairs(names) do
        if string.find(body, '"' .. name .. '"', 1, true) then quoted = true break end
    end
    if not quoted then return nil end
    local ok, envelope = pcall(cjson.decode, body)
    if ok and type(envelope) == 'table' and type(envelope.task_type) == 'string' then
        return envelope.task_type
    end
    return nil
end

local running, tat, parked_len = {}, {}, {}

-- Circuit breakers. Outcomes: the succeeded and failed counters of section 17, summed
-- over the languages of section 7.
local LANGUAGES = {'python', 'go', 'node', 'java'}
local breakers = {}

local function outcomes(t)
    local fields = {}
    for _, language in ipairs(LANGUAGES) do
        fields[#fields + 1] = t .. ' ' .. language .. ' succeeded'
        fields[#fields + 1] = t .. ' ' .. language .. ' failed'
    end
    local counts = redis.call('HMGET', base .. ':stats', unpack(fields))
    local ok, failed = 0, 0
    for i = 1, #counts, 2 do
        ok = ok + (tonumber(counts[i]) or 0)
        failed = failed + (tonumber(counts[i + 1]) or 0)
    end
    return ok, failed
end

-- A closed breaker samples the outcomes at most once a second (LIST of "<ms> <ok>
-- <failed>", newest first, kept for the window) and opens when the window holds at
-- least min_attempts outcomes of which failure_ratio or more failed.
local function should_open(t, b, key, sampled_at)
    if now - sampled_at < 1000 then return false end
    local samples = base .. ':breaker-samples:' .. t
    local ok, failed = outcomes(t)
    redis.call('LPUSH', samples, math.floor(now) .. ' ' .. ok .. ' ' .. failed)
    redis.call('HSET', key, 'sampled_at', tostring(math.floor(now)))
    local oldest, kept = nil, 0
    for index, sample in ipairs(redis.call('LRANGE', samples, 0, -1)) do
        local at, o, f = string.match(sample, '^(%S+) (%S+) (%S+)$')
        oldest, kept = {tonumber(at), tonumber(o), tonumber(f)}, index
        if now - oldest[1] >= b.window_ms then break end
    end
    redis.call('LTRIM', samples, 0, kept - 1)
    redis.call('PEXPIRE', samples, math.ceil(b.window_ms) + 60000)
    local d_ok, d_failed = ok - oldest[2], failed - oldest[3]
    return d_ok + d_failed >= b.min_attempts and d_failed >= b.ratio * (d_ok + d_failed)
end

-- The breaker of type t: {state, wait, ...}; wait 0 when an attempt may start, else
-- how long until the breaker may let one through (ms).
local function breaker_of(t)
    if breakers[t] then return breakers[t] end
    local b = limits[t].breaker
    local key = base .. ':breaker:' .. t
    local stored = redis.call('HMGET', key, 'state', 'since', 'base_ok', 'base_failed',
        'probes_started', 'sampled_at')
    local current = {state = stored[1] or 'closed', since = tonumber(stored[2]) or 0, key = key,
                     probes_started = tonumber(stored[5]) or 0, wait = 0}
    local function become(state, extra)
        current.state, current.since = state, now
        local args = {'state', state, 'since', tostring(math.floor(now))}
        for i = 1, #extra do args[#args + 1] = extra[i] end
        redis.call('HSET', key, unpack(args))
        redis.call('DEL', base .. ':breaker-samples:' .. t)
    end
    if current.state == 'closed' and should_open(t, b, key, tonumber(stored[6]) or 0) then
        become('open', {})
    end
    if current.state == 'open' then
        if now - current.since < b.cooldown_ms then
            current.wait = math.ceil(current.since + b.cooldown_ms - now)
        else  -- half-open: let `probes` attempts through, judged on their outcomes
            local ok, failed = outcomes(t)
            become('half_open', {'base_ok', tostring(ok), 'base_failed', tostring(failed),
                                 'probes_started', '0'})
            current.probes_started = 0
        end
    elseif current.state == 'half_open' then
        local ok, failed = outcomes(t)
        if failed > (tonumber(stored[4]) or 0) then
            become('open', {})
            current.wait = math.ceil(b.cooldown_ms)
        elseif ok - (tonumber(stored[3]) or 0) >= b.probes then
            become('closed', {})
        end
    end
    if current.state == 'half_open' and current.probes_started >= b.probes then
        current.wait = POLL_MS  -- the probes' outcomes are not counted yet
    end
    redis.call('PEXPIRE', key, math.ceil(b.window_ms + b.cooldown_ms) + 86400000)
    breakers[t] = current
    return current
end

local function running_key(t) return base .. ':running:' .. t end
local function rate_key(t) return base .. ':rate:' .. t end
local function parked_key(t) return base .. ':parked:' .. t end

-- 0 when an attempt of type t may start now, else how long until it may (ms).
local function wait_for(t)
    local limit = limits[t]
    if limit.breaker then
        local wait = breaker_of(t).wait
        if wait > 0 then return wait end
    end
    if limit.concurrency then
        if not running[t] then
            redis.call('ZREMRANGEBYSCORE', running_key(t), '-inf', now)
            running[t] = redis.call('ZCARD', running_key(t))
        end
        if running[t] >= limit.concurrency then return POLL_MS end
    end
    if limit.interval then
        if not tat[t] then tat[t] = tonumber(redis.call('GET', rate_key(t))) or now end
        local ahead = math.max(tat[t], now) - limit.tolerance - now
        if ahead > 0 then return math.max(1, math.ceil(ahead)) end
    end
    return 0
end

-- The slots and rate tokens taken, written once per type before the script returns.
local new_slots, tat_taken = {}, {}
local function take(t, stream, id)
    local limit = limits[t]
    if limit.breaker and breakers[t].state == 'half_open' then
        local b = breakers[t]
        b.probes_started = b.probes_started + 1
        redis.call('HSET', b.key, 'probes_started', tostring(b.probes_started))
        if b.probes_started >= limit.breaker.probes then b.wait = POLL_MS end
    end
    if limit.concurrency then
        local members = new_slots[t] or {}
        new_slots[t] = members
        members[#members + 1] = now + lease_ms
        members[#members + 1] = stream .. ' ' .. id
        running[t] = running[t] + 1
    end
    if limit.interval then
        tat_taken[t] = true
        tat[t] = math.max(tat[t], now) + limit.interval
    end
end

local function parked_count(t)
    if not parked_len[t] then parked_len[t] = redis.call('LLEN', parked_key(t)) end
    return parked_len[t]
end

local order, taken = {}, {}
local function deliver(stream, entry)
    if not taken[stream] then
        taken[stream] = {}
        order[#order + 1] = stream
    end
    local list = taken[stream]
    list[#list + 1] = entry
    left = left - 1
    limited_left = limited_left - 1  -- whatever its type, it is started before later ones
end

-- Every breaker looks at the outcomes on every call (sampling at most once a second),
-- whether entries of its type come now or not.
for _, t in ipairs(names) do
    if limits[t].breaker then breaker_of(t) end
end

-- Parked entries first, in order, while their type may start.
local parked_types = redis.call('SMEMBERS', base .. ':parked-types')
-- The oldest parked entry of type t claimed to the caller (stream, entry), or nil when
-- none is left; one that is no longer pending is dropped.
local function next_parked(t)
    while true do
        local item = redis.call('LPOP', parked_key(t))
        if not item then return nil end
        local stream, id = string.match(item, '^(.*) (%S+)$')
        local claimed = redis.call('XCLAIM', stream, ARGV[1], ARGV[2], 0, id)
        if claimed[1] and claimed[1][2] then return stream, claimed[1] end
    end
end

for _, t in ipairs(parked_types) do
    -- A type whose limit was removed hands them all out as credit allows.
    local limited = limits[t] ~= nil
    while left > 0 and (not limited or (limited_left > 0 and wait_for(t) == 0)) do
        local stream, entry = next_parked(t)
        if not stream then break end
        if limited then take(t, stream, entry[1]) end
        deliver(stream, entry)
    end
    if redis.call('LLEN', parked_key(t)) == 0 then redis.call('SREM', base .. ':parked-types', t) end
end

-- Then new entries, most urgent stream first; a parked entry does not count.
local scan_left = tonumber(ARGV[3]) + SCAN_MORE
for _, key in ipairs(KEYS) do
    while left > 0 and scan_left > 0 do
        local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS', key, '>')
        if not got or not got[1] or #got[1][2] == 0 then break end
        for _, entry in ipairs(got[1][2]) do
            scan_left = scan_left - 1
            local t = task_type(entry[2])
            if not t or not limits[t] then
                deliver(key, entry)
            elseif parked_count(t) == 0 and limited_left > 0 and wait_for(t) == 0 then
                take(t, key, entry[1])
                deliver(key, entry)
            else
                redis.call('XCLAIM', key, ARGV[1], PARKED, 0, entry[1], 'JUSTID')
                redis.call('RPUSH', parked_key(t), key .. ' ' .. entry[1])
                redis.call('SADD', base .. ':parked-types', t)
                parked_len[t] = parked_count(t) + 1
            end
        end
    end
end

local SLOTS_PER_ZADD = 500  -- score and member: 1,000 arguments a call at most
for _, t in ipairs(names) do
    local members = new_slots[t] or {}
    for first = 1, #members, 2 * SLOTS_PER_ZADD do
        redis.call('ZADD', running_key(t),
                   unpack(members, first, math.min(first + 2 * SLOTS_PER_ZADD - 1, #members)))
    end
    if tat_taken[t] then
        redis.call('SET', rate_key(t), tostring(tat[t]), 'PX', math.ceil(tat[t] - now) + 1000)
    end
end

local wait_ms, wants_slot = -1, false
for _, t in ipairs(redis.call('SMEMBERS', base .. ':parked-types')) do
    local wait = limits[t] and wait_for(t) or 0
    if wait == 0 then wait = POLL_MS end
    if wait_ms < 0 or wait < wait_ms then wait_ms = wait end
    local limit = limits[t]
    if limit and limit.concurrency and running[t] and running[t] >= limit.concurrency then
        wants_slot = true
    end
end

-- The stream a settle that frees a slot appends to (NOMKSTREAM: only while it exists).
local freed, freed_after = base .. ':slot-freed', ''
if wants_slot then
    local last = redis.call('XREVRANGE', freed, '+', '-', 'COUNT', 1)
    freed_after = last[1] and last[1][1] or redis.call('XADD', freed, '*', 't', '')
else
    redis.call('DEL', freed)
end

local reply = {}
for _, stream in ipairs(order) do reply[#reply + 1] = {stream, taken[stream]} end
return {reply, wait_ms, 1, freed_after}

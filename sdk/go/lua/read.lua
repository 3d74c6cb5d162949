-- read.lua: take up to COUNT new entries of one consumer group, most urgent stream first.
--
-- KEYS[1..n]  the streams of the queues being consumed, in the order they are served
--             (for each queue: high, normal, low, then the non-task "kombu" stream)
-- ARGV[1]     consumer group
-- ARGV[2]     consumer name
-- ARGV[3]     the most entries to take in all
--
-- Equivalent to XREADGROUP ... STREAMS <key> > on each key in turn, stopping
-- when COUNT entries were taken, so a prefetch limit is never exceeded and a
-- lower bucket is read only when the higher ones are empty. Never blocks.
-- Returns the XREADGROUP reply shape: {{key, {{id, {field, value, ...}}, ...}}, ...}.

local left = tonumber(ARGV[3])
local reply = {}
for _, key in ipairs(KEYS) do
    if left <= 0 then break end
    local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', left, 'STREAMS', key, '>')
    if got and got[1] then
        local entries = got[1][2]
        left = left - #entries
        reply[#reply + 1] = {key, entries}
    end
end
return reply

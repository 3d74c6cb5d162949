-- forget_consumer.lua: remove a long-idle consumer that holds nothing from a group.
--
-- KEYS[1]  a stream
-- ARGV[1]  consumer group
-- ARGV[2]  consumer name
-- ARGV[3]  idle time (ms) the consumer must have reached
--
-- The check and the removal happen in one step: a consumer that reads again
-- in between would otherwise have its new pending entries dropped with it.
-- Returns 1 when the consumer was removed, else 0.

local ok, consumers = pcall(redis.call, 'XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if not ok then return 0 end
for _, consumer in ipairs(consumers) do
    local info = {}
    for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
    if info['name'] == ARGV[2] then
        if tonumber(info['pending']) == 0 and tonumber(info['idle']) >= tonumber(ARGV[3]) then
            redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
            return 1
        end
        return 0
    end
end
return 0

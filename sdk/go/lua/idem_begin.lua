-- idem_begin.lua: claim an idempotency key before running a task.
--
-- KEYS[1]  <prefix>:idem:<task_type>:<idempotency_key>
-- ARGV[1]  holder: "<consumer> <task_id>"
-- ARGV[2]  how long the claim lasts without being finished (ms): timeout_ms + lease_ms,
--          or one hour without timeout_ms. A safety net only: a claim is normally
--          taken over when its consumer's liveness key is gone
-- ARGV[3]  holder to replace, or "" (set it to the holder answered by an earlier
--          call whose consumer was found dead, to take the claim over)
--
-- Key values: "running <consumer> <task_id>" while a task runs,
--             "done <task_id> <finished at, RFC 3339>" after it succeeded.
-- Returns {"acquired"}, {"done", <value>} (do not run: ack as a duplicate) or
-- {"busy", <holder>} (another consumer runs it: defer, and if that consumer's
-- liveness key is gone, call again with ARGV[3] = <holder>).

local value = redis.call('GET', KEYS[1])
if value then
    if string.sub(value, 1, 5) == 'done ' then return {'done', value} end
    local holder = string.match(value, '^running (.*)$') or value
    if holder ~= ARGV[1] and holder ~= ARGV[3] then return {'busy', holder} end
end
redis.call('SET', KEYS[1], 'running ' .. ARGV[1], 'PX', tonumber(ARGV[2]))
return {'acquired'}

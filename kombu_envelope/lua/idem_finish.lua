-- idem_finish.lua: settle an idempotency claim after the task ran.
--
-- KEYS[1]  <prefix>:idem:<task_type>:<idempotency_key>
-- ARGV[1]  holder: "<consumer> <task_id>" or "<consumer> <task_id> <entry id>" (as
--          given to idem_begin.lua; consumer names contain no spaces, the task_id is
--          the second word)
-- ARGV[2]  "done" after a success, "release" after a failure (so a retry may run)
-- ARGV[3]  for "done": how long the done marker is kept (ms), default 24 h
-- ARGV[4]  for "done": finish time, RFC 3339
--
-- Acts while the claim is still this holder's, or gone: a claim that expired or
-- was lost with a failed-over node holds nobody else, so "done" writes the
-- marker anyway (the effect happened) and "release" has nothing to delete.
-- Returns 1, or 0 when another holder had taken the claim over (the task may
-- have run twice: log it). A "done" repeated after its reply was lost finds the
-- task's own done marker and answers 1 again.

local value = redis.call('GET', KEYS[1])
if value and value ~= 'running ' .. ARGV[1] then
    local task_id = string.match(ARGV[1], '^[^ ]* ([^ ]*)') or ''
    if ARGV[2] == 'done' and value and string.sub(value, 1, 6 + #task_id) == 'done ' .. task_id .. ' ' then
        return 1
    end
    return 0
end
if ARGV[2] == 'done' then
    local task_id = string.match(ARGV[1], '^[^ ]* ([^ ]*)') or ''
    redis.call('SET', KEYS[1], 'done ' .. task_id .. ' ' .. ARGV[4], 'PX', tonumber(ARGV[3]))
else
    redis.call('DEL', KEYS[1])
end
return 1

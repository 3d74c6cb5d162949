-- dead_letter.lua: move a pending entry to the queue's dead-letter stream.
--
-- KEYS[1]  the stream holding the entry
-- KEYS[2]  the queue's dead-letter stream <prefix>:{<queue>}:dead
-- ARGV[1]  consumer group
-- ARGV[2]  entry id
-- ARGV[3..] field, value pairs describing the failure (dlq, failure_class,
--           reason, dead_at, ...; see docs/protocol.md)
--
-- The dead-letter entry gets the failure fields followed by every field of
-- the original entry, byte for byte, under the name "raw.<field>". The entry
-- is then acknowledged and deleted. Runs atomically, so an entry is
-- dead-lettered at most once.
-- Returns the dead-letter entry id, or false when the entry was not pending.

local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then return false end
local found = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
local dead = {}
for i = 3, #ARGV do dead[#dead + 1] = ARGV[i] end
if found[1] then
    local fields = found[1][2]
    for i = 1, #fields, 2 do
        dead[#dead + 1] = 'raw.' .. fields[i]
        dead[#dead + 1] = fields[i + 1]
    end
end
local id = redis.call('XADD', KEYS[2], '*', unpack(dead))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return id

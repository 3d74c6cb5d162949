package io.kombuenvelope;

import io.lettuce.core.XAddArgs;
import io.lettuce.core.ZAddArgs;
import io.lettuce.core.api.sync.RedisCommands;

import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.stream.Collectors;

/**
 * The concurrency slots of the entries a worker holds from queues with limits (docs/protocol.md
 * section 19): renewed with each liveness renewal, one MULTI per queue ({@code ZADD XX}, so a slot
 * freed meanwhile is not taken again), and freed in the MULTI of the acknowledgement that settles
 * the entry. retry.lua, dead_letter.lua and requeue.lua free the slots themselves.
 */
final class Slots {
    /** The slot of one entry: member {@code "<stream> <entry id>"} of the running set of its type. */
    record Slot(String queue, String key, byte[] member, String freed, byte[] taskType) {
        /** Adds the ZREM that frees it, and the append to slot-freed that wakes the consumers
         * waiting for a slot (section 19), to a MULTI of its queue. */
        void free(RedisCommands<String, byte[]> tx) {
            tx.zrem(key, member);
            tx.xadd(freed, XAddArgs.Builder.maxlen(1).exactTrimming().nomkstream(), Map.of("t", taskType));
        }
    }

    private final Keys keys;
    private final long leaseMs;
    private final Map<String, Slot> held = new ConcurrentHashMap<>();

    Slots(Keys keys, long leaseMs) {
        this.keys = keys;
        this.leaseMs = leaseMs;
    }

    /** Notes the slot entry {@code id} of {@code stream} (of type {@code taskType}) may hold. */
    void hold(String queue, String stream, String id, String taskType) {
        String member = stream + " " + id;
        held.put(member, new Slot(queue, keys.running(queue, taskType), Redis.b(member), keys.slotFreed(queue),
                Redis.b(taskType)));
    }

    /** The slot entry {@code id} of {@code stream} may hold, or null. */
    Slot of(String stream, String id) {
        return held.get(stream + " " + id);
    }

    /** Stops renewing the slot of entry {@code id} of {@code stream} (it was settled). */
    void release(String stream, String id) {
        held.remove(stream + " " + id);
    }

    /** Renews every slot held for another {@code lease_ms}, one MULTI per queue on {@code tx}. */
    void renew(Link tx) {
        Map<String, List<Slot>> byQueue = held.values().stream().collect(Collectors.groupingBy(Slot::queue));
        byQueue.forEach((queue, slots) -> {
            double deadline = System.currentTimeMillis() + leaseMs;
            tx.transaction(slots.get(0).key(), t -> {
                for (Slot s : slots) {
                    t.zadd(s.key(), ZAddArgs.Builder.xx(), deadline, s.member());
                }
            });
        });
    }
}

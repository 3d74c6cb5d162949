package io.kombuenvelope;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * What read.lua answered for one queue, called with {@code lease_ms} and the free run capacity
 * (docs/protocol.md sections 5 and 19): the entries taken, in stream order; {@code waitMs}, the
 * longest wait before reading that queue again while entries are parked ({@code -1}: none are);
 * {@code limited}, whether the queue has limits; {@code freedAfter}, while entries wait for a
 * slot, the id of slot-freed to wait on from (empty: none wait).
 */
record ReadReply(List<StreamEntry> entries, long waitMs, boolean limited, String freedAfter) {
    /** One entry taken from {@code stream}. */
    record StreamEntry(String stream, String id, Map<String, byte[]> fields) {}

    /** Reads the reply {@code {reply, wait_ms, limited, freed_after}}, {@code reply} in the XREADGROUP shape. */
    @SuppressWarnings("unchecked")
    static ReadReply parse(List<Object> reply) {
        if (reply == null || reply.size() != 4 || !(reply.get(0) instanceof List)) {
            throw new IllegalStateException("read.lua answered " + reply + ", not {reply, wait_ms, limited, "
                    + "freed_after}: is its copy older than revision 9?");
        }
        List<StreamEntry> entries = new ArrayList<>();
        for (Object s : (List<Object>) reply.get(0)) {
            List<Object> streamReply = (List<Object>) s;
            String stream = Redis.s(streamReply.get(0));
            for (Object m : (List<Object>) streamReply.get(1)) {
                List<Object> msg = (List<Object>) m;
                Map<String, byte[]> fields = new LinkedHashMap<>();
                if (msg.get(1) instanceof List) {
                    List<Object> flat = (List<Object>) msg.get(1);
                    for (int i = 0; i + 1 < flat.size(); i += 2) {
                        fields.put(Redis.s(flat.get(i)), (byte[]) flat.get(i + 1));
                    }
                }
                entries.add(new StreamEntry(stream, Redis.s(msg.get(0)), fields));
            }
        }
        return new ReadReply(entries, ((Number) reply.get(1)).longValue(), ((Number) reply.get(2)).longValue() == 1,
                Redis.s(reply.get(3)));
    }
}

package io.kombuenvelope;

import java.util.Map;

/**
 * What became of a task (docs/protocol.md section 14): {@code state} as a reader reports it
 * ({@code scheduled}, {@code queued}, {@code running}, {@code retrying}, {@code succeeded},
 * {@code dead}, {@code cancelled}, {@code failed} or {@code unknown}), the queue its record was
 * found in (the queue asked for, or null, when none was), and the record's fields as written
 * (empty without a record).
 */
public record TaskInfo(String taskId, String queue, String state, Map<String, String> record) {
    public TaskInfo {
        record = Map.copyOf(record);
    }
}

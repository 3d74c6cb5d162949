package io.kombuenvelope;

/**
 * What a publish stored: the task's id, and the stream entry id when it went to a stream now
 * (null when it was stored in the delayed set; {@value #WAITING} when it has an
 * {@code ordering_key} whose turn has not come: it waits in Redis, in no stream, until the tasks
 * of its key before it are settled, docs/protocol.md section 20).
 */
public record PublishResult(String taskId, String entryId, boolean delayed) {
    /** The entry id of a keyed task stored to wait for its turn (enqueue.lua's answer {@code waiting}). */
    public static final String WAITING = "waiting";

    /** Whether the task waits for its ordering key's turn (stored, and in no stream yet). */
    public boolean waiting() {
        return WAITING.equals(entryId);
    }
}

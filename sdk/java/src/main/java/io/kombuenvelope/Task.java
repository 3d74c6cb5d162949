package io.kombuenvelope;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.ObjectNode;

import java.time.Duration;

/** One attempt of a task, as given to a {@link TaskHandler}. */
public final class Task {
    private final Envelope envelope;
    private final String queue;
    private final String stream;
    private final String entryId;
    private final int redeliveries;

    Task(Envelope envelope, String queue, String stream, String entryId, int redeliveries) {
        this.envelope = envelope;
        this.queue = queue;
        this.stream = stream;
        this.entryId = entryId;
        this.redeliveries = redeliveries;
    }

    public Envelope envelope() { return envelope; }
    public String taskId() { return envelope.taskId(); }
    public String taskType() { return envelope.taskType(); }
    public String traceId() { return envelope.traceId(); }
    public long retryCount() { return envelope.retryCount(); }
    /** A copy of the payload. */
    public ObjectNode payload() { return envelope.payload(); }
    /** One payload member (a missing node when absent). */
    public JsonNode get(String name) { return envelope.payload().path(name); }
    public String queue() { return queue; }
    public String stream() { return stream; }
    public String entryId() { return entryId; }
    /** How many times this entry was taken back from a dead consumer or put back ({@code n} + {@code r}). */
    public int redeliveries() { return redeliveries; }

    /** An explicit retry after {@code countdown}: {@code throw task.retry(...)}. */
    public TaskFailure.Retry retry(String why, Duration countdown) {
        return new TaskFailure.Retry(why, countdown);
    }
}

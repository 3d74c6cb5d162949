package io.kombuenvelope;

import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.TreeSet;

/**
 * A task that no live or recently seen worker of its queue serves (docs/protocol.md section 15),
 * refused by a producer built with {@code requireServed(true)}; {@link #serves()} is what the
 * queue's workers serve (task type to payload versions, an empty list meaning every version).
 */
public final class NotServedException extends IllegalStateException {
    private static final long serialVersionUID = 1L;
    private final String queue;
    private final String taskType;
    private final long payloadVersion;
    private final transient Map<String, List<Long>> serves;

    NotServedException(String queue, String taskType, long payloadVersion, Map<String, List<Long>> serves) {
        super("task_type \"" + taskType + "\" payload_version " + payloadVersion + " is not served on queue \""
                + queue + "\"; its workers serve " + (serves.isEmpty() ? "nothing: no worker of this queue was seen"
                : Json.MAPPER.valueToTree(serves).toString()));
        this.queue = queue;
        this.taskType = taskType;
        this.payloadVersion = payloadVersion;
        this.serves = Collections.unmodifiableMap(serves);
    }

    /**
     * Null when an announcement serves {@code e} on {@code queue}, else the exception naming what
     * the queue's workers serve.
     */
    static NotServedException check(List<Announcement> announced, String queue, Envelope e) {
        Map<String, List<Long>> serves = new TreeMap<>();
        for (Announcement a : announced) {
            if (a.accepts(queue, e.taskType(), e.payloadVersion())) {
                return null;
            }
            if (a.queues().contains(queue)) {
                a.serves().forEach((type, versions) -> serves.merge(type, versions, NotServedException::union));
            }
        }
        return new NotServedException(queue, e.taskType(), e.payloadVersion(), serves);
    }

    /** Merges version lists; an empty list (every version) absorbs the others. */
    private static List<Long> union(List<Long> have, List<Long> more) {
        if (have.isEmpty() || more.isEmpty()) {
            return List.of();
        }
        TreeSet<Long> all = new TreeSet<>(have);
        all.addAll(more);
        return new ArrayList<>(all);
    }

    public String queue() { return queue; }
    public String taskType() { return taskType; }
    public long payloadVersion() { return payloadVersion; }
    /** What the queue's live or recently seen workers serve. */
    public Map<String, List<Long>> serves() { return serves; }
}

package io.kombuenvelope;

import java.util.List;

/** Key names under one prefix (docs/protocol.md section 2). */
public final class Keys {
    public static final String DEFAULT_PREFIX = "envelope";
    public static final String DEFAULT_GROUP = "workers";
    /** The reserved consumer that holds parked entries (section 19); never taken over. */
    public static final String PARKED_CONSUMER = "parked";
    public static final List<String> BUCKETS = List.of("high", "normal", "low");

    private final String prefix;

    public Keys(String prefix) {
        if (prefix == null || prefix.isEmpty()) {
            throw new IllegalArgumentException("prefix must be non-empty");
        }
        this.prefix = prefix;
    }

    public String prefix() { return prefix; }

    /** The bucket of a priority (higher is more urgent). */
    public static String bucketFor(int priority) {
        if (priority >= 170) {
            return "high";
        }
        return priority >= 85 ? "normal" : "low";
    }

    /** Refuses names that cannot be a Redis Cluster hash tag. */
    public static String checkQueueName(String queue) {
        if (queue == null || queue.isEmpty() || queue.contains("{") || queue.contains("}")) {
            throw new IllegalArgumentException("queue name " + queue + " must be non-empty and contain no '{' or '}'");
        }
        return queue;
    }

    public String base(String queue) { return prefix + ":{" + queue + "}"; }
    public String stream(String queue, String bucket) { return base(queue) + ":" + bucket; }
    public List<String> taskStreams(String queue) {
        return List.of(stream(queue, "high"), stream(queue, "normal"), stream(queue, "low"));
    }
    public String delayed(String queue) { return base(queue) + ":delayed"; }
    public String delayedData(String queue) { return base(queue) + ":delayed:data"; }
    public String published(String queue, String taskId) { return base(queue) + ":published:" + taskId; }
    public String dead(String queue) { return base(queue) + ":dead"; }
    public String replayed(String queue) { return base(queue) + ":replayed"; }
    /** The worker statistics of {@code queue}, in its slot (section 17). */
    public String stats(String queue) { return base(queue) + ":stats"; }
    /** The task record of {@code taskId} in {@code queue} (section 14). */
    public String task(String queue, String taskId) { return base(queue) + ":task:" + taskId; }
    /** The limits per task type of {@code queue}, field {@code <task_type>} (section 19). */
    public String limits(String queue) { return base(queue) + ":limits"; }
    /** The concurrency slots of {@code taskType} in {@code queue}, scored by their deadlines (section 19). */
    public String running(String queue, String taskType) { return base(queue) + ":running:" + taskType; }

    /** The stream a settle that frees a slot appends to, while entries wait for one (section 19). */
    public String slotFreed(String queue) { return base(queue) + ":slot-freed"; }
    /** The task_ids of ordering key {@code key} in {@code queue}, in the order they joined; the head's turn (section 20). */
    public String order(String queue, String key) { return base(queue) + ":order:" + key; }
    /** The keyed tasks of {@code key} in {@code queue} waiting for their turn, field {@code task_id} (section 20). */
    public String orderWaiting(String queue, String key) { return base(queue) + ":order-waiting:" + key; }
    /** The ordering keys of {@code queue} whose head was settled, for promote.lua to release the next (section 20). */
    public String orderAdvanced(String queue) { return base(queue) + ":order-advanced"; }
    /** The ordering keys of {@code queue} held by runs acknowledged before they ended (section 20). */
    public String orderHeld(String queue) { return base(queue) + ":order-held"; }
    /** What a dead-lettered head does to its key, field {@code <task_type>}: {@code advance} or {@code halt} (section 20). */
    public String orderPolicy(String queue) { return base(queue) + ":order-policy"; }
    /** The halted ordering keys of {@code queue}, field {@code <key>}: the dead-lettered head's task_id (section 20). */
    public String orderHalted(String queue) { return base(queue) + ":order-halted"; }
    public String queues() { return prefix + ":queues"; }
    public String deadQueues() { return prefix + ":dead-queues"; }
    public String periodicQueues() { return prefix + ":periodic-queues"; }
    /** Consumers that announced themselves, scored by when they last did (section 15). */
    public String workers() { return prefix + ":workers"; }
    /** The announcement of {@code consumer} (section 15). */
    public String worker(String consumer) { return prefix + ":worker:" + consumer; }
    /** Payload schemas, field {@code <task_type>@<payload_version>} (section 16). */
    public String schemas() { return prefix + ":schemas"; }
    /** Cancel marks of every queue (section 10). */
    public String cancelled() { return prefix + ":cancelled"; }
    public String consumer(String name) { return prefix + ":consumer:" + name; }
    public String idempotency(String taskType, String key) { return prefix + ":idem:" + taskType + ":" + key; }
    public String retrying(String taskType) { return prefix + ":retrying:" + taskType; }
    public String wakeup() { return prefix + ":wakeup"; }
}

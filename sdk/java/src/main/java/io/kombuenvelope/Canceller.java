package io.kombuenvelope;

import io.lettuce.core.Range;
import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.TransactionResult;
import io.lettuce.core.ZAddArgs;
import io.lettuce.core.cluster.RedisClusterClient;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.TreeSet;

/**
 * Cancels tasks by id (docs/protocol.md section 10): marks the id in {@code <prefix>:cancelled},
 * which every worker of every queue looks up before running a task, then removes the task from
 * the delayed set of every queue in {@code <prefix>:queues} (or of the one queue named) with
 * cancel.lua. Thread-safe; close it when done. {@link Producer#cancel(String)} uses one.
 */
public final class Canceller implements AutoCloseable {
    /** How long a cancel mark is kept. */
    public static final Duration MARK_TTL = Duration.ofDays(7);

    private final AbstractRedisClient client;
    private final boolean ownsClient;
    private final Link link;
    private final Keys keys;
    private final Duration outageTolerance;
    private final TaskRecords records;

    private Canceller(AbstractRedisClient client, boolean ownsClient, Keys keys, Duration outageTolerance,
                      TaskRecords records) {
        this.client = client;
        this.ownsClient = ownsClient;
        this.link = Redis.closingOnFailure(client, ownsClient, () -> Link.open(client, Link.Durability.NONE));
        this.keys = keys;
        this.outageTolerance = outageTolerance;
        this.records = records;
    }

    /** A canceller on a client it does not own (the producer's). */
    static Canceller on(AbstractRedisClient client, Keys keys, Duration outageTolerance, TaskRecords records) {
        return new Canceller(client, false, keys, outageTolerance, records);
    }

    public static Builder builder() {
        return new Builder();
    }

    /** Cancels {@code taskId} wherever it is: the mark, then every queue's delayed set. */
    public CancelResult cancel(String taskId) {
        return run(null, taskId);
    }

    /** Cancels {@code taskId}, looking for it only in the delayed set of {@code queue}. */
    public CancelResult cancel(String queue, String taskId) {
        return run(Keys.checkQueueName(queue), taskId);
    }

    /**
     * One cancel at a time: the mark is a MULTI on the canceller's connection (one key, so one
     * slot), and each queue's cancel.lua touches that queue's slot only.
     */
    private synchronized CancelResult run(String onlyQueue, String taskId) {
        Envelope.checkTaskId(taskId);
        boolean marked = Redis.retrying(link, outageTolerance, () -> mark(taskId));
        List<String> queues = onlyQueue != null ? List.of(onlyQueue) : Redis.retrying(link, outageTolerance, this::queues);
        String removedFrom = null;
        for (String queue : queues) {
            String now = TaskRecords.time(java.time.Instant.now());
            TaskRecords.Step record = records.finalStep(queue, taskId, Map.of("finished_at", now, "reason", "cancelled",
                    "updated_at", now));
            byte[] r = Redis.retrying(link, outageTolerance, () -> Scripts.run(link.sync(), "cancel",
                    ScriptOutputType.VALUE, record.keys(List.of(keys.delayed(queue), keys.delayedData(queue))),
                    record.args(1, taskId)));
            if ("removed".equals(Redis.s(r)) && removedFrom == null) {
                removedFrom = queue;
            }
        }
        if (removedFrom != null) {
            return new CancelResult(CancelResult.Outcome.REMOVED, removedFrom);
        }
        return new CancelResult(marked ? CancelResult.Outcome.MARKED : CancelResult.Outcome.ALREADY, null);
    }

    /** Drops marks older than a week and adds this one, in one MULTI; answers whether it is new. */
    private boolean mark(String taskId) {
        long now = System.currentTimeMillis();
        TransactionResult r = link.transaction(keys.cancelled(), tx -> {
            tx.zremrangebyscore(keys.cancelled(), Range.from(Range.Boundary.unbounded(),
                    Range.Boundary.including(now - MARK_TTL.toMillis())));
            tx.zadd(keys.cancelled(), ZAddArgs.Builder.nx(), (double) now, Redis.b(taskId));
        });
        return Long.valueOf(1).equals(r.get(1));
    }

    private List<String> queues() {
        TreeSet<String> names = new TreeSet<>();
        link.sync().smembers(keys.queues()).forEach(b -> names.add(Redis.s(b)));
        return new ArrayList<>(names);
    }

    @Override
    public void close() {
        link.close();
        if (ownsClient) {
            Redis.shutdown(client);
        }
    }

    /** Options of a {@link Canceller}. */
    public static final class Builder {
        private String redisUri = "redis://127.0.0.1:6379";
        private AbstractRedisClient client;
        private String prefix = Keys.DEFAULT_PREFIX;
        private Duration outageTolerance = Duration.ofSeconds(30);
        private Duration taskRecordRetention = TaskRecords.DEFAULT_RETENTION;

        private Builder() {}

        /** A Redis URL, also Sentinel or Cluster (see {@link RedisUrl}); checked at once. */
        public Builder redisUri(String v) { RedisUrl.parse(v); redisUri = v; return this; }
        /** Share a Lettuce client, direct or Sentinel (the canceller then does not shut it down). */
        public Builder client(RedisClient v) { client = v; return this; }
        /** Share a Lettuce Redis Cluster client (the canceller then does not shut it down). */
        public Builder client(RedisClusterClient v) { client = v; return this; }
        public Builder prefix(String v) { prefix = v; return this; }
        /** How long each step is retried while Redis is unreachable (30 s by default). */
        public Builder outageTolerance(Duration v) { outageTolerance = Objects.requireNonNull(v); return this; }
        /** How long the record of a cancelled task is kept ({@code task_record_retention}, 1 h); zero: no records. */
        public Builder taskRecordRetention(Duration v) { taskRecordRetention = Objects.requireNonNull(v); return this; }

        public Canceller build() {
            boolean owns = client == null;
            Keys keys = new Keys(prefix);
            return new Canceller(Redis.clientOr(client, redisUri), owns, keys, outageTolerance,
                    new TaskRecords(keys, taskRecordRetention));
        }
    }
}

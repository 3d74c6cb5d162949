package io.kombuenvelope;

import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.cluster.RedisClusterClient;

import java.util.Map;
import java.util.Objects;
import java.util.Optional;
import java.util.TreeMap;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Sets, reads and removes the limits per task type of queues (docs/protocol.md section 19), in the
 * hash {@code <prefix>:{<queue>}:limits}: field the task type, value the canonical JSON of a
 * {@link TaskLimit}. Workers of every language apply a change at their next read, without a restart.
 */
public final class TaskLimits implements AutoCloseable {
    private static final Logger LOG = LoggerFactory.getLogger(TaskLimits.class);

    private final AbstractRedisClient client;
    private final boolean ownsClient;
    private final Link link;
    private final Keys keys;

    private TaskLimits(Builder b) {
        this.ownsClient = b.client == null;
        this.client = Redis.clientOr(b.client, b.redisUri);
        this.link = Redis.closingOnFailure(client, ownsClient, () -> Link.open(client, Link.Durability.NONE));
        this.keys = new Keys(b.prefix);
    }

    public static Builder builder() {
        return new Builder();
    }

    /** Sets the limits of {@code taskType} on {@code queue}, replacing any. */
    public void set(String queue, String taskType, TaskLimit limit) {
        Objects.requireNonNull(limit, "limit");
        link.sync().hset(key(queue), checkType(taskType), Redis.b(limit.toJson()));
    }

    /**
     * The limits of {@code taskType} on {@code queue}, empty when it has none; a stored value that
     * breaks the schema throws {@link InvalidLimitException} (workers ignore such a value).
     */
    public Optional<TaskLimit> get(String queue, String taskType) {
        byte[] v = link.sync().hget(key(queue), checkType(taskType));
        return v == null ? Optional.empty() : Optional.of(TaskLimit.parse(Redis.s(v)));
    }

    /**
     * Every task type's limits on {@code queue}, by task type; a stored value that breaks the
     * schema is left out and logged (workers ignore it too).
     */
    public Map<String, TaskLimit> list(String queue) {
        Map<String, TaskLimit> out = new TreeMap<>();
        link.sync().hgetall(key(queue)).forEach((type, v) -> {
            try {
                out.put(type, TaskLimit.parse(Redis.s(v)));
            } catch (InvalidLimitException e) {
                LOG.warn("the limits of {} on queue {} are ignored by workers: {}", type, queue, e.getMessage());
            }
        });
        return out;
    }

    /** Removes the limits of {@code taskType} on {@code queue}; answers whether it had any. */
    public boolean remove(String queue, String taskType) {
        return link.sync().hdel(key(queue), checkType(taskType)) > 0;
    }

    private String key(String queue) {
        return keys.limits(Keys.checkQueueName(queue));
    }

    private static String checkType(String taskType) {
        if (taskType == null || taskType.isEmpty()) {
            throw new IllegalArgumentException("task_type must be a non-empty string");
        }
        return taskType;
    }

    @Override
    public void close() {
        link.close();
        if (ownsClient) {
            Redis.shutdown(client);
        }
    }

    /** Options of {@link TaskLimits}. */
    public static final class Builder {
        private String redisUri = "redis://127.0.0.1:6379";
        private AbstractRedisClient client;
        private String prefix = Keys.DEFAULT_PREFIX;

        private Builder() {}

        /** A Redis URL, also Sentinel or Cluster (see {@link RedisUrl}); checked at once. */
        public Builder redisUri(String v) { RedisUrl.parse(v); redisUri = v; return this; }
        /** Share a Lettuce client, direct or Sentinel (then it is not shut down here). */
        public Builder client(RedisClient v) { client = v; return this; }
        /** Share a Lettuce Redis Cluster client (then it is not shut down here). */
        public Builder client(RedisClusterClient v) { client = v; return this; }
        public Builder prefix(String v) { prefix = Objects.requireNonNull(v); return this; }

        public TaskLimits build() {
            return new TaskLimits(this);
        }
    }
}

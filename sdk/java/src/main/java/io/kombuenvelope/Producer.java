package io.kombuenvelope;

import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.cluster.RedisClusterClient;

import io.opentelemetry.api.OpenTelemetry;

import java.security.SecureRandom;
import java.time.Duration;
import java.time.Instant;
import java.util.HexFormat;
import java.util.List;
import java.util.Map;
import java.util.Objects;

/**
 * Publishes Envelopes (docs/protocol.md section 4): due tasks with enqueue.lua, future ones with
 * schedule.lua, each publish with one token sent unchanged with every try, so a publish retried
 * after a lost reply is stored once. A due task with an {@code ordering_key} goes to its stream
 * only when its key's turn has come, else it waits ({@link PublishResult#waiting()}, section 20).
 * Works on one server, behind Sentinel and on Redis Cluster (each publish touches its queue's
 * slot only); optionally waits for replicas after each publish. Thread-safe; close it when done.
 */
public final class Producer implements AutoCloseable {
    /** How long a publish token is remembered (ms): the retry time plus a minute. */
    public static final long PUBLISH_DEDUPE_MS = 90_000;
    private static final SecureRandom RANDOM = new SecureRandom();

    private final AbstractRedisClient client;
    private final boolean ownsClient;
    private final Link link;
    private final Keys keys;
    private final String queue;
    private final Limits limits;
    private final int gzipMin;
    private final Duration outageTolerance;
    private final TaskRecords records;
    private final PayloadSchemas schemas;
    private final boolean requireServed;
    private final Tracing tracing;
    private Canceller canceller;

    private Producer(Builder b) {
        this.ownsClient = b.client == null;
        this.client = Redis.clientOr(b.client, b.redisUri);
        this.link = Redis.closingOnFailure(client, ownsClient, () -> Link.open(client, b.durability));
        this.keys = new Keys(b.prefix);
        this.queue = Keys.checkQueueName(b.queue);
        this.limits = b.limits;
        this.gzipMin = b.gzipMin;
        this.outageTolerance = b.outageTolerance;
        this.records = new TaskRecords(keys, b.taskRecordRetention);
        this.schemas = new PayloadSchemas(() -> Redis.retrying(link, outageTolerance,
                () -> link.sync().hgetall(keys.schemas())), b.schemaCache);
        this.requireServed = b.requireServed;
        this.tracing = new Tracing(b.openTelemetry);
    }

    public static Builder builder() {
        return new Builder();
    }

    /** A random publish token without spaces. */
    public static String newPublishToken() {
        byte[] b = new byte[12];
        RANDOM.nextBytes(b);
        return HexFormat.of().formatHex(b);
    }

    /** Publishes to the producer's queue. */
    public PublishResult publish(Envelope e) {
        return publish(queue, e);
    }

    /** Builds and publishes a task of {@code taskType} with {@code payload} to the producer's queue. */
    public PublishResult publish(String taskType, Map<String, ?> payload) {
        return publish(queue, Envelope.builder(taskType).payload(payload).build());
    }

    /**
     * Publishes several Envelopes to the producer's queue, in order; answers one result each. All
     * are checked (rules, payload schemas, the served check when asked for) before any is stored.
     */
    public List<PublishResult> publishAll(List<Envelope> envelopes) {
        Instant now = Instant.now();
        List<Envelope> valid = envelopes.stream().map(e -> checked(queue, e, now)).toList();
        List<PublishResult> out = new java.util.ArrayList<>(valid.size());
        for (Envelope e : valid) {
            out.add(store(queue, e, now));
        }
        return out;
    }

    /** Publishes {@code e} to run after {@code delay} (its schedule_time is set to now + delay). */
    public PublishResult publishIn(Envelope e, Duration delay) {
        return publishIn(queue, e, delay);
    }

    /** Publishes {@code e} to {@code queue} to run after {@code delay}. */
    public PublishResult publishIn(String queue, Envelope e, Duration delay) {
        return publish(queue, e.toBuilder().scheduleTime(Instant.now().plus(delay)).build());
    }

    /**
     * Publishes to {@code queue}: validated (including {@code max_delay}) and checked against the
     * payload schema of its type and version, then stored in its priority stream when due, else in
     * the delayed set, with its task record. A due task with an {@code ordering_key} whose turn has
     * not come is stored to wait for it: its result's entry id is {@link PublishResult#WAITING}.
     *
     * @throws EnvelopeValidationException naming the field and the rule ({@code schema} for a
     *         payload that breaks its schema, on field {@code payload<path>})
     * @throws NotServedException when the producer requires a served task and no worker serves it
     */
    public PublishResult publish(String queue, Envelope e) {
        Instant now = Instant.now();
        return store(queue, checked(queue, e, now), now);
    }

    /** {@code e} validated for a publish to {@code queue} at {@code now}: rules, schema, served check. */
    private Envelope checked(String queue, Envelope e, Instant now) {
        Keys.checkQueueName(queue);
        Objects.requireNonNull(e, "envelope");
        Envelope valid = e.validate(limits);
        valid.checkPublishable(limits, now);
        List<SchemaViolation> broken = schemas.violations(valid);
        if (!broken.isEmpty()) {
            throw new EnvelopeValidationException(broken.stream().map(SchemaViolation::toViolation).toList());
        }
        if (requireServed) {
            NotServedException refused = NotServedException.check(announcements(), queue, valid);
            if (refused != null) {
                throw refused;
            }
        }
        return valid;
    }

    /**
     * Stores a checked Envelope with its task record inside its {@code send <queue>} span, with
     * the trace context it is published in (docs/protocol.md section 18).
     */
    private PublishResult store(String queue, Envelope checked, Instant now) {
        Tracing.Send span = tracing.send(queue, checked);
        try {
            return write(queue, span.stamp(checked, limits), now);
        } catch (RuntimeException e) {
            span.fail(e);
            throw e;
        } finally {
            span.end();
        }
    }

    private PublishResult write(String queue, Envelope valid, Instant now) {
        EntryCodec.Body body = EntryCodec.encodeBody(valid, gzipMin, limits);
        String bucket = Keys.bucketFor(valid.priority());
        String token = newPublishToken();
        String taskId = valid.taskId();
        Map<String, String> fields = TaskRecords.published(valid, queue);
        fields.put("published_at", TaskRecords.time(now));
        if (valid.isDue(now)) {
            if (valid.orderingKey() != null) {
                // Promoters release the next task of a key: they must serve the queue (section 20).
                register(queue);
            }
            String stream = keys.stream(queue, bucket);
            TaskRecords.Step record = records.activeStep(queue, taskId, 0, fields);
            byte[] id = Redis.retrying(link, outageTolerance, () -> link.write(stream, r -> Scripts.run(r, "enqueue",
                    ScriptOutputType.VALUE, record.keys(List.of(stream, keys.delayed(queue), keys.delayedData(queue),
                            keys.published(queue, taskId))),
                    record.args(5, taskId, body.enc(), body.bytes(), token, PUBLISH_DEDUPE_MS))));
            return new PublishResult(taskId, Redis.s(id), false);
        }
        long due = valid.dueMs(now.toEpochMilli());
        fields.put("due_at", TaskRecords.time(Instant.ofEpochMilli(due)));
        TaskRecords.Step record = records.activeStep(queue, taskId, due, fields);
        register(queue);
        String delayed = keys.delayed(queue);
        Redis.retrying(link, outageTolerance, () -> link.write(delayed, r -> Scripts.run(r, "schedule",
                ScriptOutputType.INTEGER,
                record.keys(List.of(delayed, keys.delayedData(queue), keys.published(queue, taskId))),
                record.args(8, taskId, due, bucket, body.enc(), body.bytes(), keys.wakeup(), token, PUBLISH_DEDUPE_MS))));
        return new PublishResult(taskId, null, true);
    }

    /**
     * {@code SADD <prefix>:queues <queue>}, on its own, before a store promoters must serve: a crash
     * in between leaves a listed empty queue (section 2, registries).
     */
    private void register(String queue) {
        Redis.retrying(link, outageTolerance, () -> link.sync().sadd(keys.queues(), Redis.b(queue)));
    }

    /**
     * What became of {@code taskId}, looked for in every queue of the registries and of the
     * announced workers (a task published now to a queue nobody lists is found only by
     * {@link #getTask(String, String)}).
     */
    public TaskInfo getTask(String taskId) {
        return Redis.retrying(link, outageTolerance, () -> new TaskStates(link.sync(), keys).get(null, taskId));
    }

    /** What became of {@code taskId} in {@code queue} (docs/protocol.md section 14). */
    public TaskInfo getTask(String queue, String taskId) {
        Keys.checkQueueName(queue);
        return Redis.retrying(link, outageTolerance, () -> new TaskStates(link.sync(), keys).get(queue, taskId));
    }

    /** The announcements of the workers live or seen within the last hour (docs/protocol.md section 15). */
    public List<Announcement> announcements() {
        return Redis.retrying(link, outageTolerance, () -> Announcements.read(link.sync(), keys));
    }

    /**
     * Cancels a task in whatever queue it is (docs/protocol.md section 10) and answers the
     * outcome word: {@code removed}, {@code marked} or {@code already}. {@link #canceller()} also
     * answers the queue it was removed from.
     */
    public String cancel(String taskId) {
        return canceller().cancel(taskId).outcome().word();
    }

    /** Cancels a task, looking for it only in the delayed set of {@code queue}; answers the outcome word. */
    public String cancel(String queue, String taskId) {
        return canceller().cancel(queue, taskId).outcome().word();
    }

    /** The producer's {@link Canceller} (same client, prefix and outage tolerance), opened on first use. */
    public synchronized Canceller canceller() {
        if (canceller == null) {
            canceller = Canceller.on(client, keys, outageTolerance, records);
        }
        return canceller;
    }

    @Override
    public void close() {
        synchronized (this) {
            if (canceller != null) {
                canceller.close();
            }
        }
        link.close();
        if (ownsClient) {
            Redis.shutdown(client);
        }
    }

    /** Options of a {@link Producer}. */
    public static final class Builder {
        private String redisUri = "redis://127.0.0.1:6379";
        private AbstractRedisClient client;
        private String prefix = Keys.DEFAULT_PREFIX;
        private String queue = "celery";
        private Limits limits = Limits.DEFAULT;
        private int gzipMin = EntryCodec.GZIP_MIN_BYTES;
        private Duration outageTolerance = Duration.ofSeconds(30);
        private Link.Durability durability = Link.Durability.NONE;
        private Duration taskRecordRetention = TaskRecords.DEFAULT_RETENTION;
        private Duration schemaCache = PayloadSchemas.DEFAULT_CACHE;
        private boolean requireServed;
        private OpenTelemetry openTelemetry;

        private Builder() {}

        /**
         * A Redis URL: {@code redis://127.0.0.1:6379/0}, a Sentinel ({@code redis-sentinel://...#master})
         * or a Cluster ({@code redis-cluster://...}); see {@link RedisUrl}. Checked at once.
         */
        public Builder redisUri(String v) { RedisUrl.parse(v); redisUri = v; return this; }
        /** Share a Lettuce client, direct or Sentinel (the producer then does not shut it down). */
        public Builder client(RedisClient v) { client = v; return this; }
        /** Share a Lettuce Redis Cluster client (the producer then does not shut it down). */
        public Builder client(RedisClusterClient v) { client = v; return this; }
        /**
         * After each publish, {@code WAIT} for {@code replicas} replicas of the primary that took it,
         * at most {@code timeout}; fewer is logged and the publish stands (0, the default: no WAIT).
         */
        public Builder waitReplicas(int replicas, Duration timeout) {
            durability = new Link.Durability(replicas, timeout);
            return this;
        }
        public Builder prefix(String v) { prefix = v; return this; }
        /** The default queue of {@link #publish(Envelope)}; {@code celery} unless set. */
        public Builder queue(String v) { queue = Keys.checkQueueName(v); return this; }
        public Builder limits(Limits v) { limits = Objects.requireNonNull(v); return this; }
        /** Bodies of at least this many bytes are gzip-compressed; 0: never. */
        public Builder gzipMinBytes(int v) { gzipMin = v; return this; }
        /** How long a publish is retried while Redis is unreachable (30 s by default). */
        public Builder outageTolerance(Duration v) { outageTolerance = Objects.requireNonNull(v); return this; }
        /**
         * How long the record of a finished task is kept ({@code task_record_retention}, 1 h by
         * default); zero writes no task records (docs/protocol.md section 14).
         */
        public Builder taskRecordRetention(Duration v) { taskRecordRetention = Objects.requireNonNull(v); return this; }
        /** How long payload schemas read from Redis are used ({@code schema_cache_s}, 30 s by default). */
        public Builder schemaCache(Duration v) { schemaCache = Objects.requireNonNull(v); return this; }
        /**
         * Refuse, with {@link NotServedException}, a task that no live or recently seen worker of
         * its queue serves in its payload version (off by default; docs/protocol.md section 15).
         */
        public Builder requireServed(boolean v) { requireServed = v; return this; }
        /**
         * The OpenTelemetry whose tracer makes the {@code send <queue>} spans; unless set,
         * {@link io.opentelemetry.api.GlobalOpenTelemetry} (a no-op until an SDK is installed).
         */
        public Builder openTelemetry(OpenTelemetry v) { openTelemetry = Objects.requireNonNull(v); return this; }

        public Producer build() {
            return new Producer(this);
        }
    }
}

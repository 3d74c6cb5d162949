package io.kombuenvelope;

import io.lettuce.core.Limit;
import io.lettuce.core.Range;
import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.StreamMessage;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.sync.RedisClusterCommands;

import java.net.InetAddress;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.TreeSet;
import java.util.function.UnaryOperator;

/** Lists, gets, counts, purges and replays dead-letter entries (the same operations as Python's DeadLetters). */
public final class DeadLetters implements AutoCloseable {
    private final AbstractRedisClient client;
    private final boolean ownsClient;
    private final Link link;
    private final Keys keys;
    private final Limits limits;
    private final int gzipMin;
    private final TaskRecords records;
    private final PayloadSchemas schemas;

    private DeadLetters(Builder b) {
        this.ownsClient = b.client == null;
        this.client = Redis.clientOr(b.client, b.redisUri);
        this.link = Redis.closingOnFailure(client, ownsClient, () -> Link.open(client, Link.Durability.NONE));
        this.keys = new Keys(b.prefix);
        this.limits = b.limits;
        this.gzipMin = b.gzipMin;
        this.records = new TaskRecords(keys, b.taskRecordRetention);
        this.schemas = new PayloadSchemas(() -> redis().hgetall(keys.schemas()), b.schemaCache);
    }

    public static Builder builder() {
        return new Builder();
    }

    /** Queues that have had dead-letter entries, sorted. */
    public List<String> queues() {
        TreeSet<String> out = new TreeSet<>();
        for (byte[] q : redis().smembers(keys.deadQueues())) {
            out.add(Redis.s(q));
        }
        return new ArrayList<>(out);
    }

    /** Up to {@code limit} entries of {@code queue}, oldest first. */
    public List<DeadLetter> list(String queue, int limit) {
        List<DeadLetter> out = new ArrayList<>();
        for (StreamMessage<String, byte[]> m : redis().xrange(keys.dead(Keys.checkQueueName(queue)),
                Range.create("-", "+"), Limit.from(limit))) {
            out.add(entry(queue, m.getId(), m.getBody()));
        }
        return out;
    }

    /** One entry by id, or null. */
    public DeadLetter get(String queue, String entryId) {
        List<StreamMessage<String, byte[]>> found = redis().xrange(keys.dead(Keys.checkQueueName(queue)),
                Range.create(entryId, entryId));
        return found.isEmpty() ? null : entry(queue, entryId, found.get(0).getBody());
    }

    public long count(String queue) {
        return redis().xlen(keys.dead(Keys.checkQueueName(queue)));
    }

    /** Deletes entries by id; answers how many were deleted. */
    public long delete(String queue, String... entryIds) {
        return entryIds.length == 0 ? 0 : redis().xdel(keys.dead(Keys.checkQueueName(queue)), entryIds);
    }

    /** Replays unchanged (retry_count back to 0, runs now). */
    public String replay(String queue, String entryId, String operator) {
        return replay(queue, entryId, UnaryOperator.identity(), operator);
    }

    /**
     * Publishes a dead-lettered task again, once, with replay.lua, after {@code edit} (given the
     * Envelope with retry_count 0 and no schedule_time). Answers the new entry id,
     * {@link PublishResult#WAITING} when the task has an {@code ordering_key} whose turn has not
     * come (it joins its key's order, docs/protocol.md section 20; the replay of the head a key
     * halted for runs it again as the head), or null when the entry is gone (replayed or purged by
     * someone else first).
     *
     * @throws MalformedEntryException when the entry holds no decodable Envelope
     * @throws EnvelopeValidationException when the edited Envelope is invalid or its payload breaks
     *         its schema (rule {@code schema})
     */
    public String replay(String queue, String entryId, UnaryOperator<Envelope.Builder> edit, String operator) {
        DeadLetter d = get(queue, entryId);
        if (d == null) {
            return null;
        }
        if (d.envelope() == null) {
            throw new IllegalStateException(new MalformedEntryException("envelope",
                    "dead-letter entry " + entryId + " holds no valid Envelope: " + d.decodeError(), null));
        }
        Envelope e = edit.apply(d.envelope().toBuilder().retryCount(0).scheduleTime((Timestamp) null)
                .limits(limits)).build();
        e.checkPublishable(limits, java.time.Instant.now());
        List<SchemaViolation> broken = schemas.violations(e);
        if (!broken.isEmpty()) {
            throw new EnvelopeValidationException(broken.stream().map(SchemaViolation::toViolation).toList());
        }
        EntryCodec.Body body = EntryCodec.encodeBody(e, gzipMin, limits);
        String who = operator != null ? operator : System.getProperty("user.name", "?") + "@" + hostName();
        TaskRecords.Step record = records.activeStep(queue, e.taskId(), 0, TaskRecords.published(e, queue));
        if (e.orderingKey() != null) {
            // Promoters release the next task of a key: the registry first, on its own (sections 2, 20).
            redis().sadd(keys.queues(), Redis.b(queue));
        }
        byte[] r = Scripts.run(redis(), "replay", ScriptOutputType.VALUE,
                record.keys(List.of(keys.dead(queue), keys.stream(queue, Keys.bucketFor(e.priority())),
                        keys.replayed(queue))),
                record.args(3, entryId, body.enc(), body.bytes(), "replayed_at", Timestamp.now().toString(),
                        "operator", who));
        return Redis.s(r);
    }

    /** Commands routed by key: every operation touches one queue's slot, or the registry alone. */
    private RedisClusterCommands<String, byte[]> redis() {
        return link.sync();
    }

    private DeadLetter entry(String queue, String id, Map<String, byte[]> fields) {
        Map<String, String> failure = new LinkedHashMap<>();
        Map<String, byte[]> raw = new LinkedHashMap<>();
        fields.forEach((k, v) -> {
            if (k.startsWith("raw.")) {
                raw.put(k.substring(4), v);
            } else {
                failure.put(k, Redis.s(v));
            }
        });
        Envelope env = null;
        String error = null;
        try {
            env = EntryCodec.decodeEntry(raw, limits);
        } catch (MalformedEntryException e) {
            error = e.kind() + ": " + e.getMessage();
        }
        return new DeadLetter(queue, id, Collections.unmodifiableMap(failure), Collections.unmodifiableMap(raw), env, error);
    }

    private static String hostName() {
        try {
            return InetAddress.getLocalHost().getHostName();
        } catch (Exception e) {
            return "localhost";
        }
    }

    @Override
    public void close() {
        link.close();
        if (ownsClient) {
            Redis.shutdown(client);
        }
    }

    /** Options of {@link DeadLetters}. */
    public static final class Builder {
        private String redisUri = "redis://127.0.0.1:6379";
        private AbstractRedisClient client;
        private String prefix = Keys.DEFAULT_PREFIX;
        private Limits limits = Limits.DEFAULT;
        private int gzipMin = EntryCodec.GZIP_MIN_BYTES;
        private Duration taskRecordRetention = TaskRecords.DEFAULT_RETENTION;
        private Duration schemaCache = PayloadSchemas.DEFAULT_CACHE;

        private Builder() {}

        /** A Redis URL, also Sentinel or Cluster (see {@link RedisUrl}); checked at once. */
        public Builder redisUri(String v) { RedisUrl.parse(v); redisUri = v; return this; }
        /** Share a Lettuce client, direct or Sentinel (the tool then does not shut it down). */
        public Builder client(RedisClient v) { client = v; return this; }
        /** Share a Lettuce Redis Cluster client (the tool then does not shut it down). */
        public Builder client(RedisClusterClient v) { client = v; return this; }
        public Builder prefix(String v) { prefix = Objects.requireNonNull(v); return this; }
        public Builder limits(Limits v) { limits = Objects.requireNonNull(v); return this; }
        public Builder gzipMinBytes(int v) { gzipMin = v; return this; }
        /** How long task records are kept ({@code task_record_retention}, 1 h); zero: no records. */
        public Builder taskRecordRetention(Duration v) { taskRecordRetention = Objects.requireNonNull(v); return this; }
        /** How long payload schemas read from Redis are used ({@code schema_cache_s}, 30 s). */
        public Builder schemaCache(Duration v) { schemaCache = Objects.requireNonNull(v); return this; }

        public DeadLetters build() {
            return new DeadLetters(this);
        }
    }
}

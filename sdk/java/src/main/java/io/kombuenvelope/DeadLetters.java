package io.kombuenvelope;

import io.lettuce.core.Limit;
import io.lettuce.core.Range;
import io.lettuce.core.RedisClient;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.StreamMessage;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.api.sync.RedisCommands;

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
    private final RedisClient client;
    private final boolean ownsClient;
    private final StatefulRedisConnection<String, byte[]> conn;
    private final RedisCommands<String, byte[]> redis;
    private final Keys keys;
    private final Limits limits;
    private final int gzipMin;

    private DeadLetters(Builder b) {
        this.ownsClient = b.client == null;
        this.client = b.client != null ? b.client : Redis.client(b.redisUri);
        this.conn = client.connect(Redis.CODEC);
        this.redis = conn.sync();
        this.keys = new Keys(b.prefix);
        this.limits = b.limits;
        this.gzipMin = b.gzipMin;
    }

    public static Builder builder() {
        return new Builder();
    }

    /** Queues that have had dead-letter entries, sorted. */
    public List<String> queues() {
        TreeSet<String> out = new TreeSet<>();
        for (byte[] q : redis.smembers(keys.deadQueues())) {
            out.add(Redis.s(q));
        }
        return new ArrayList<>(out);
    }

    /** Up to {@code limit} entries of {@code queue}, oldest first. */
    public List<DeadLetter> list(String queue, int limit) {
        List<DeadLetter> out = new ArrayList<>();
        for (StreamMessage<String, byte[]> m : redis.xrange(keys.dead(Keys.checkQueueName(queue)),
                Range.create("-", "+"), Limit.from(limit))) {
            out.add(entry(queue, m.getId(), m.getBody()));
        }
        return out;
    }

    /** One entry by id, or null. */
    public DeadLetter get(String queue, String entryId) {
        List<StreamMessage<String, byte[]>> found = redis.xrange(keys.dead(Keys.checkQueueName(queue)),
                Range.create(entryId, entryId));
        return found.isEmpty() ? null : entry(queue, entryId, found.get(0).getBody());
    }

    public long count(String queue) {
        return redis.xlen(keys.dead(Keys.checkQueueName(queue)));
    }

    /** Deletes entries by id; answers how many were deleted. */
    public long delete(String queue, String... entryIds) {
        return entryIds.length == 0 ? 0 : redis.xdel(keys.dead(Keys.checkQueueName(queue)), entryIds);
    }

    /** Replays unchanged (retry_count back to 0, runs now). */
    public String replay(String queue, String entryId, String operator) {
        return replay(queue, entryId, UnaryOperator.identity(), operator);
    }

    /**
     * Publishes a dead-lettered task again, once, with replay.lua, after {@code edit} (given the
     * Envelope with retry_count 0 and no schedule_time). Answers the new entry id, or null when
     * the entry is gone (replayed or purged by someone else first).
     *
     * @throws MalformedEntryException when the entry holds no decodable Envelope
     * @throws EnvelopeValidationException when the edited Envelope is invalid
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
        EntryCodec.Body body = EntryCodec.encodeBody(e, gzipMin, limits);
        String who = operator != null ? operator : System.getProperty("user.name", "?") + "@" + hostName();
        byte[] r = Scripts.run(redis, "replay", ScriptOutputType.VALUE,
                List.of(keys.dead(queue), keys.stream(queue, Keys.bucketFor(e.priority())), keys.replayed(queue)),
                entryId, body.enc(), body.bytes(), "replayed_at", Timestamp.now().toString(), "operator", who);
        return Redis.s(r);
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
        conn.close();
        if (ownsClient) {
            client.shutdown(Duration.ZERO, Duration.ofSeconds(2));
        }
    }

    /** Options of {@link DeadLetters}. */
    public static final class Builder {
        private String redisUri = "redis://127.0.0.1:6379";
        private RedisClient client;
        private String prefix = Keys.DEFAULT_PREFIX;
        private Limits limits = Limits.DEFAULT;
        private int gzipMin = EntryCodec.GZIP_MIN_BYTES;

        private Builder() {}

        public Builder redisUri(String v) { redisUri = Objects.requireNonNull(v); return this; }
        public Builder client(RedisClient v) { client = v; return this; }
        public Builder prefix(String v) { prefix = Objects.requireNonNull(v); return this; }
        public Builder limits(Limits v) { limits = Objects.requireNonNull(v); return this; }
        public Builder gzipMinBytes(int v) { gzipMin = v; return this; }

        public DeadLetters build() {
            return new DeadLetters(this);
        }
    }
}

package io.kombuenvelope;

import io.lettuce.core.Range;
import io.lettuce.core.SetArgs;
import io.lettuce.core.cluster.api.sync.RedisClusterCommands;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Writes and reads worker announcements (docs/protocol.md section 15): {@code ZADD
 * <prefix>:workers} first and awaited, then {@code SET <prefix>:worker:<consumer> PX}; readers
 * drop registry members older than a day and read each announcement with its own GET (the keys
 * have no hash tag).
 */
final class Announcements {
    /** How long an announcement is kept after it was written ({@code announce_keep_ms}). */
    static final Duration KEEP = Duration.ofHours(1);
    /** How long a member of {@code <prefix>:workers} is kept by its readers. */
    private static final long LISTED_MS = Duration.ofDays(1).toMillis();
    private static final Logger LOG = LoggerFactory.getLogger(Announcements.class);

    private Announcements() {}

    /** Writes {@code a}: the registry first, then the key. */
    static void write(RedisClusterCommands<String, byte[]> redis, Keys keys, Announcement a) {
        redis.zadd(keys.workers(), (double) System.currentTimeMillis(), Redis.b(a.consumer()));
        redis.set(keys.worker(a.consumer()), Redis.b(a.toJson()), SetArgs.Builder.px(KEEP.toMillis()));
    }

    /** The announcements of the workers seen within {@link #KEEP} (live or recently seen). */
    static List<Announcement> read(RedisClusterCommands<String, byte[]> redis, Keys keys) {
        long cut = System.currentTimeMillis() - LISTED_MS;
        redis.zremrangebyscore(keys.workers(), Range.create(Double.NEGATIVE_INFINITY, (double) cut));
        List<Announcement> out = new ArrayList<>();
        for (byte[] member : redis.zrange(keys.workers(), 0, -1)) {
            String consumer = Redis.s(member);
            byte[] value = redis.get(keys.worker(consumer));
            if (value == null) {
                continue;
            }
            try {
                out.add(Announcement.parse(Redis.s(value)));
            } catch (IllegalArgumentException e) {
                LOG.warn("unreadable announcement of worker {} ignored: {}", consumer, e.getMessage());
            }
        }
        return out;
    }
}

package io.kombuenvelope;

import java.util.HashMap;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.atomic.AtomicLong;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * What a worker counts of its attempts in {@code <prefix>:{<queue>}:stats} (docs/protocol.md
 * section 17): outcomes and the run and wait histograms, per queue, task type and language, kept
 * in memory summed per field and written with {@link #flush(Link)} (one MULTI of {@code HINCRBY}s
 * and the {@code PEXPIRE} per queue, in the queue's slot). A write that fails keeps its counts for
 * the next one; nothing here ever throws into the handling of a task.
 */
final class WorkerStats {
    /** The task type of an entry whose Envelope could not be decoded. */
    static final String UNDECODABLE = "-";
    /** How long the hash is kept after a write, in ms (30 days). */
    static final long KEEP_MS = 2_592_000_000L;
    /** The bucket bounds as written in field names, and in microseconds ({@code inf}: none). */
    static final List<String> BOUNDS = List.of("0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1", "2.5",
            "5", "10", "30", "60", "300", "900", "3600", "inf");
    private static final long[] BOUNDS_US = {5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000,
        2_500_000, 5_000_000, 10_000_000, 30_000_000, 60_000_000, 300_000_000, 900_000_000, 3_600_000_000L,
        Long.MAX_VALUE};
    /**
     * At most this many (queue, task type) pairs are buffered, 41 fields each: counts of a pair
     * beyond it (task types nobody serves, sent in bulk) are left out and the loss is logged.
     */
    static final int MAX_TASK_TYPES = 512;
    private static final Logger LOG = LoggerFactory.getLogger(WorkerStats.class);

    /** The outcomes of the table of section 17. */
    enum Outcome {
        SUCCEEDED, FAILED, RETRIED, DEAD, DUPLICATE;

        String field() {
            return name().toLowerCase(Locale.ROOT);
        }
    }

    private final Keys keys;
    private final String language;
    /** Counts not written yet: queue, then field. */
    private final Map<String, Map<String, Long>> pending = new LinkedHashMap<>();
    /** The task types buffered, per queue. */
    private final Map<String, Set<String>> types = new HashMap<>();
    private int pairs;
    /** Held by a flush (never while counting: a flush that waits for Redis delays no task). */
    private final Object flushing = new Object();
    private boolean closed;
    private final AtomicLong leftOut = new AtomicLong();

    WorkerStats(Keys keys, String language) {
        this.keys = keys;
        this.language = language;
    }

    /** Counts one {@code outcome} of {@code taskType} ({@link #UNDECODABLE} when none) in {@code queue}. */
    void count(String queue, String taskType, Outcome outcome) {
        add(queue, taskType, Map.of(outcome.field(), 1L));
    }

    /** An attempt's handler ran for {@code nanos}. */
    void ran(String queue, String taskType, long nanos) {
        observe(queue, taskType, "run", nanos);
    }

    /** An attempt waited {@code nanos} to start (a negative wait counts as 0). */
    void waited(String queue, String taskType, long nanos) {
        observe(queue, taskType, "wait", nanos);
    }

    private void observe(String queue, String taskType, String name, long nanos) {
        long ns = Math.max(0, nanos);
        int i = 0;
        while (BOUNDS_US[i] != Long.MAX_VALUE && ns > BOUNDS_US[i] * 1000) {
            i++;
        }
        add(queue, taskType, Map.of(name + "_le_" + BOUNDS.get(i), 1L, name + "_sum_us", Math.round(ns / 1000.0)));
    }

    private synchronized void add(String queue, String taskType, Map<String, Long> counts) {
        Set<String> known = types.computeIfAbsent(queue, q -> new HashSet<>());
        if (!known.contains(taskType)) {
            if (pairs >= MAX_TASK_TYPES) {
                leftOut.incrementAndGet();
                return;
            }
            known.add(taskType);
            pairs++;
        }
        Map<String, Long> fields = pending.computeIfAbsent(queue, q -> new HashMap<>());
        String prefix = taskType + " " + language + " ";
        counts.forEach((name, n) -> fields.merge(prefix + name, n, Long::sum));
    }

    /** The counts not written yet, per queue and field (a copy). */
    synchronized Map<String, Map<String, Long>> pending() {
        Map<String, Map<String, Long>> copy = new LinkedHashMap<>();
        pending.forEach((q, f) -> copy.put(q, new HashMap<>(f)));
        return copy;
    }

    /**
     * Writes the counts of each queue in one MULTI on {@code link}; those written are taken off the
     * buffer, a queue whose write failed keeps them (logged). Never throws; one flush at a time.
     */
    void flush(Link link) {
        synchronized (flushing) {
            if (!closed) {
                write(link);
            }
        }
    }

    /**
     * The last write, when the worker stops: waits for a flush under way, then writes what is
     * left; later flushes write nothing (so stopping the thread that renews interrupts none).
     */
    void close(Link link) {
        synchronized (flushing) {
            closed = true;
            write(link);
        }
    }

    private void write(Link link) {
        long lost = leftOut.getAndSet(0);
        if (lost > 0) {
            LOG.warn("{} statistics counts were left out: more than {} task types in the buffer", lost, MAX_TASK_TYPES);
        }
        for (Map.Entry<String, Map<String, Long>> q : pending().entrySet()) {
            String key = keys.stats(q.getKey());
            try {
                link.transaction(key, tx -> {
                    q.getValue().forEach((field, n) -> tx.hincrby(key, field, n));
                    tx.pexpire(key, KEEP_MS);
                });
                written(q.getKey(), q.getValue());
            } catch (RuntimeException e) {
                link.recover(e);
                LOG.warn("writing the statistics of queue {} failed; kept for the next renewal: {}", q.getKey(),
                        e.toString());
            }
        }
    }

    /** Takes {@code written} off the buffer of {@code queue} (counts added meanwhile stay). */
    private synchronized void written(String queue, Map<String, Long> written) {
        Map<String, Long> fields = pending.get(queue);
        written.forEach((field, n) -> {
            if (fields.merge(field, -n, Long::sum) == 0) {
                fields.remove(field);
            }
        });
        if (fields.isEmpty()) {
            pending.remove(queue);
            pairs -= types.remove(queue).size();
        }
    }
}

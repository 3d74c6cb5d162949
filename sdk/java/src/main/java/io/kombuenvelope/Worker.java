package io.kombuenvelope;

import com.fasterxml.jackson.databind.JsonNode;

import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.Consumer;
import io.lettuce.core.Limit;
import io.lettuce.core.models.stream.PendingMessage;
import io.lettuce.core.models.stream.PendingMessages;
import io.lettuce.core.Range;
import io.lettuce.core.RedisBusyException;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisException;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.StreamMessage;
import io.lettuce.core.TransactionResult;
import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XPendingArgs;
import io.lettuce.core.XReadArgs;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.sync.RedisClusterCommands;

import io.opentelemetry.api.OpenTelemetry;
import io.opentelemetry.context.Scope;

import java.io.PrintWriter;
import java.io.StringWriter;
import java.net.InetAddress;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.Semaphore;
import java.util.concurrent.ThreadFactory;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.Predicate;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;
import org.slf4j.MDC;

/**
 * Consumes one queue or several, in their configured order (docs/protocol.md sections 5, 5.1, 8,
 * 9): reads with read.lua in the consumer group, queue by queue with the credit left and with one
 * blocking read per queue, renews its liveness key from its own thread, runs registered handlers within
 * {@code timeout_ms}, acknowledges successes, retries with retry.lua, claims idempotency keys and
 * dead-letters malformed entries, unknown task types and final failures. Cancelled and expired
 * tasks are acknowledged without running (sections 5.1, 10); given a result backend, it writes
 * the results Celery callers ask for (section 12). Runs a promoter unless told not to.
 * On a queue with limits per task type (section 19) it passes its free run capacity to read.lua,
 * re-reads within the wait read.lua asks for while entries are parked, renews the concurrency
 * slots of the entries it holds with its liveness key and frees them with their acknowledgement.
 * A task with an ordering key (section 20) moves its key on in the MULTI of its final
 * acknowledgement and wakes the promoters, which release the key's next task.
 * Runs on one server, behind Sentinel and on Redis Cluster: every step touches its queue's slot
 * only (registries on their own, first), and failover errors are waited out, never fatal.
 * {@link #start()} it, {@link #close()} it.
 */
public final class Worker implements AutoCloseable {
    public static final String LANGUAGE = "java";
    private static final Logger LOG = LoggerFactory.getLogger(Worker.class);

    private final Builder cfg;
    private final Map<String, Handler> handlers;
    private final AbstractRedisClient client;
    private final boolean ownsClient;
    /** Commands and the writes that settle entries (WAIT follows them on the same connection). */
    private final Link link;
    /** MULTI/EXEC only, one at a time. */
    private final Link txLink;
    /**
     * The writes of the lease thread beside the liveness key: statistics (section 17) and slot
     * renewals (section 19), never waiting for replicas; a write that waits for Redis holds up no ack.
     */
    private final Link leaseLink;
    /** The blocking reads only: one per queue, each waiting on that queue's streams. */
    private final Map<String, Link> blockLinks = new LinkedHashMap<>();
    /** The blocking reads under way, per queue. */
    private final Map<String, CompletableFuture<Void>> waits = new HashMap<>();
    private final ExecutorService waiters;
    private final Keys keys;
    private final List<String> queues;
    /** The queues joined with commas, for logs and thread names. */
    private final String name;
    private final String consumer;
    private final String host;
    private final String pid;
    private final Semaphore credit;
    private final ExecutorService pool;
    private final ExecutorService handlerThreads;
    private final ScheduledExecutorService lease;
    private final AtomicBoolean stopping = new AtomicBoolean();
    private final AtomicInteger inFlight = new AtomicInteger();
    private final Liveness liveness;
    private volatile Thread loop;
    private volatile long lastForget;
    private volatile boolean recoverPending = true;
    private final Set<String> inFlightIds = java.util.concurrent.ConcurrentHashMap.newKeySet();
    /** The idempotency keys an attempt of this consumer claims, from before idem_begin.lua until settled (section 9). */
    private final Set<String> claiming = java.util.concurrent.ConcurrentHashMap.newKeySet();
    /** The concurrency slots of the entries held from queues with limits (section 19). */
    private final Slots slots;
    /** What the last read.lua call of each queue said about its limits. */
    private final Map<String, ReadState> readStates = new java.util.concurrent.ConcurrentHashMap<>();
    private volatile Promoter promoter;
    private final CeleryResults results;
    private final AbandonedClaims abandoned;
    private final TaskRecords records;
    private final PayloadSchemas schemas;
    private final WorkerStats stats;
    private final Tracing tracing;
    private final Instant startedAt = Instant.now();

    private Worker(Builder b) {
        this.cfg = b;
        this.handlers = Map.copyOf(b.handlers);
        this.ownsClient = b.client == null;
        this.client = Redis.clientOr(b.client, b.redisUri);
        this.link = Redis.closingOnFailure(client, ownsClient,
                () -> starting("connecting", () -> Link.open(client, b.durability)));
        this.txLink = Redis.closingOnFailure(client, ownsClient,
                () -> starting("connecting", () -> Link.open(client, b.durability)));
        this.leaseLink = Redis.closingOnFailure(client, ownsClient,
                () -> starting("connecting", () -> Link.open(client, Link.Durability.NONE)));
        this.queues = List.copyOf(b.queues);
        this.name = String.join(",", queues);
        for (String q : queues) {
            Link l = Redis.closingOnFailure(client, ownsClient,
                    () -> starting("connecting", () -> Link.open(client, Link.Durability.NONE)));
            l.setTimeout(b.block.plusSeconds(3));
            blockLinks.put(q, l);
        }
        this.keys = new Keys(b.prefix);
        this.host = hostName();
        this.pid = String.valueOf(ProcessHandle.current().pid());
        this.consumer = b.consumer != null ? b.consumer
                : host.replace(' ', '_') + "-" + pid + "-" + UUID.randomUUID().toString().substring(0, 8);
        this.liveness = new Liveness(client, link, keys, consumer, Redis.b(host + " " + pid + " " + LANGUAGE),
                b.leaseMs);
        this.slots = new Slots(keys, b.leaseMs);
        this.credit = new Semaphore(b.concurrency);
        this.pool = Executors.newFixedThreadPool(b.concurrency, named("envelope-worker-" + name));
        this.handlerThreads = Executors.newCachedThreadPool(named("envelope-task-" + name));
        this.lease = Executors.newSingleThreadScheduledExecutor(named("envelope-lease-" + name));
        this.waiters = Executors.newCachedThreadPool(named("envelope-wait-" + name));
        this.results = new CeleryResults(b.resultBackend);
        this.abandoned = new AbandonedClaims(lease);
        this.records = new TaskRecords(keys, b.taskRecordRetention);
        this.schemas = new PayloadSchemas(() -> redis().hgetall(keys.schemas()), b.schemaCache);
        this.stats = new WorkerStats(keys, LANGUAGE);
        this.tracing = new Tracing(b.openTelemetry);
    }

    public static Builder builder() {
        return new Builder();
    }

    public String consumer() {
        return consumer;
    }

    /** The first queue it consumes. */
    public String queue() {
        return queues.get(0);
    }

    /** The queues it consumes, in the order it serves them. */
    public List<String> queues() {
        return queues;
    }

    /** Each task type this worker runs, with the payload versions it accepts, in order. */
    public Map<String, List<Long>> serves() {
        Map<String, List<Long>> serves = new java.util.TreeMap<>();
        handlers.forEach((type, h) -> serves.put(type, h.versions.stream().sorted().toList()));
        return serves;
    }

    /** Creates the consumer groups, sets the liveness key and starts reading, renewing and promoting. */
    public synchronized Worker start() {
        if (loop != null) {
            return this;
        }
        starting("creating the consumer groups", () -> {
            ensureGroups();
            return null;
        });
        starting("setting the liveness key", liveness::renew);
        announce(false);
        long every = liveness.intervalMs();
        lease.scheduleWithFixedDelay(this::leaseTick, every, every, TimeUnit.MILLISECONDS);
        if (cfg.runPromoter) {
            promoter = starting("starting the promoter",
                    () -> Promoter.builder().client(client).prefix(cfg.prefix).build().start());
        }
        loop = new Thread(this::runLoop, "envelope-read-" + name);
        loop.setDaemon(true);
        loop.start();
        if (cfg.closeOnShutdown) {
            Runtime.getRuntime().addShutdownHook(new Thread(this::close, "envelope-shutdown-" + name));
        }
        LOG.atInfo().addKeyValue("queue", name).addKeyValue("consumer", consumer)
                .addKeyValue("concurrency", cfg.concurrency).addKeyValue("task_types", serves())
                .addKeyValue("result_backend", results.hasBackend()).log("worker started");
        return this;
    }

    /**
     * A step of building or starting the worker, repeated while Redis is unreachable or failing over
     * (a Cluster primary that died, a failover under way) for at most the outage tolerance, finding
     * the new primary meanwhile; the first such error logs that bound (docs/protocol.md section 5).
     */
    private <T> T starting(String what, java.util.function.Supplier<T> step) {
        AtomicBoolean told = new AtomicBoolean();
        return Redis.retrying(e -> {
            if (Redis.isOutage(e) && told.compareAndSet(false, true)) {
                LOG.warn("{} while starting failed; Redis is unreachable or failing over, retrying for up to {} ms: {}",
                        what, cfg.outageTolerance.toMillis(), e.toString());
            }
            if (link != null) {
                link.recover(e);
            } else if (client instanceof RedisClusterClient cluster) {
                try {
                    cluster.refreshPartitions();
                } catch (RuntimeException ignored) {
                    // the next try reads the slot map again
                }
            }
        }, cfg.outageTolerance, step);
    }

    /** Whether the read loop runs (it stops only when the worker is closed). */
    boolean isReading() {
        Thread l = loop;
        return l != null && l.isAlive() && !stopping.get();
    }

    /** Starts and blocks until the worker is closed from another thread. */
    public void run() throws InterruptedException {
        start();
        loop.join();
    }

    /** Commands routed by their first key; after a failover, those of the new primary. */
    private RedisClusterCommands<String, byte[]> redis() {
        return link.sync();
    }

    // --- liveness ---------------------------------------------------------------------------

    /**
     * Renews the liveness key, writes the announcement and the statistics and, after two renewals
     * in a row answered at once, takes over dead consumers' entries; a renewal or takeover command
     * that waited for Redis stops that round.
     */
    private void leaseTick() {
        try {
            boolean counted = liveness.renew();
            renewSlots();
            announce(false);
            stats.flush(leaseLink);
            if (!counted) {
                LOG.info("the liveness key was renewed late; no takeover until two renewals in a row "
                        + "are answered at once");
                return;
            }
            if (liveness.mayTakeOver() && !stopping.get() && cfg.takeOver) {
                takeOverDeadConsumers();
                long now = System.currentTimeMillis();
                if (now - lastForget >= cfg.forgetEvery.toMillis()) {
                    lastForget = now;
                    forgetDeadConsumers();
                }
            }
        } catch (Liveness.Waited e) {
            LOG.warn("takeover round stopped: {}", e.getMessage());
        } catch (RuntimeException e) {
            link.recover(e);
            LOG.warn("renewing the liveness key or taking over failed: {}", e.toString());
        }
    }

    /** Renews the concurrency slots held (section 19); a failure is logged, the next tick tries again. */
    private void renewSlots() {
        try {
            slots.renew(leaseLink);
        } catch (RuntimeException e) {
            leaseLink.recover(e);
            LOG.warn("renewing the concurrency slots failed: {}", e.toString());
        }
    }

    /** This consumer's announcement (docs/protocol.md section 15); {@code stopped} marks a clean shutdown. */
    Announcement announcement(boolean stopped) {
        String now = TaskRecords.time(Instant.now());
        return new Announcement(consumer, LANGUAGE, host, Long.parseLong(pid), queues, serves(), cfg.concurrency,
                TaskRecords.time(startedAt), now, stopped ? now : null, liveness.intervalMs());
    }

    /** Writes the announcement with the liveness key; a failure is logged, the worker goes on. */
    private void announce(boolean stopped) {
        try {
            Announcements.write(redis(), keys, announcement(stopped));
        } catch (RuntimeException e) {
            link.recover(e);
            LOG.warn("writing the worker announcement failed: {}", e.toString());
        }
    }

    /**
     * Puts back the entries of consumers whose liveness key is gone (section 5), counting a
     * redelivery; after {@code maxRedeliveries} they are dead-lettered as {@code redelivery_limit}.
     * Throws {@link Liveness.Waited} when one of its commands waited for Redis: the round stops.
     */
    int takeOverDeadConsumers() {
        int moved = 0;
        for (String queue : queues) {
            moved += takeOverDeadConsumers(queue);
        }
        return moved;
    }

    private int takeOverDeadConsumers(String queue) {
        int moved = 0;
        for (String stream : keys.taskStreams(queue)) {
            PendingMessages summary;
            try {
                summary = liveness.prompt("reading the pending summary", () -> redis().xpending(stream, cfg.group));
            } catch (RedisException e) {
                continue;
            }
            if (summary == null || summary.getConsumerMessageCount() == null) {
                continue;
            }
            for (String owner : summary.getConsumerMessageCount().keySet()) {
                // The entries of "parked" wait for their task type's limits; they are not abandoned.
                if (owner.equals(consumer) || owner.equals(Keys.PARKED_CONSUMER) || liveness.alive(owner)) {
                    continue;
                }
                List<PendingMessage> idle = liveness.prompt("reading the entries of " + owner, () -> redis().xpending(
                        stream, XPendingArgs.Builder.xpending(Consumer.from(cfg.group, owner), Range.create("-", "+"),
                                Limit.from(100)).idle(Duration.ofMillis(cfg.leaseMs))));
                if (!idle.isEmpty()) {
                    // requeue.lua may dead-letter: the registry first, on its own (section 2).
                    liveness.prompt("registering the dead-letter queue",
                            () -> redis().sadd(keys.deadQueues(), Redis.b(queue)));
                }
                for (PendingMessage m : idle) {
                    String now = TaskRecords.time(Instant.now());
                    Envelope pendingEnv = liveness.prompt("reading entry " + m.getId(),
                            () -> pendingEnvelope(stream, m.getId()));
                    TaskRecords.Step record = pendingEnv != null && records.enabled()
                            ? records.requeueStep(queue, pendingEnv.taskId()) : TaskRecords.Step.NONE;
                    Liveness.Look look = liveness.look("taking over entry " + m.getId());
                    byte[] r = link.write(stream, node -> look.timed(() -> Scripts.run(node, "requeue",
                            ScriptOutputType.VALUE, record.keys(List.of(stream, stream, keys.dead(queue))),
                            record.args(7, cfg.group, m.getId(), owner, cfg.leaseMs, 1, cfg.maxRedeliveries, now,
                                    "queue", queue, "language", LANGUAGE, "host", host, "pid", pid, "consumer", owner,
                                    "first_failure_at", now, "last_failure_at", now))));
                    String answer = Redis.s(r);
                    if (answer != null) {
                        moved++;
                        if (answer.startsWith("dead:")) {
                            LOG.error("entry {} of dead consumer {} dead-lettered after too many redeliveries",
                                    m.getId(), owner);
                            stats.count(queue, pendingEnv != null ? pendingEnv.taskType() : WorkerStats.UNDECODABLE,
                                    WorkerStats.Outcome.DEAD);
                            reportRedeliveryLimit(queue, answer.substring("dead:".length()));
                        } else {
                            LOG.warn("took over entry {} of dead consumer {}", m.getId(), owner);
                        }
                    }
                    look.check();
                }
            }
        }
        return moved;
    }

    /**
     * The Envelope of entry {@code id} of {@code stream} about to be taken over (its task_id names
     * the record requeue.lua writes, its task_type the statistics); null when it is gone or cannot
     * be decoded.
     */
    private Envelope pendingEnvelope(String stream, String id) {
        List<StreamMessage<String, byte[]>> found = redis().xrange(stream, Range.create(id, id));
        if (found.size() != 1) {
            return null;
        }
        try {
            return EntryCodec.decodeEntry(found.get(0).getBody(), cfg.limits);
        } catch (MalformedEntryException e) {
            return null;
        }
    }

    /**
     * Removes dead consumers that hold nothing and were idle for {@code forgetAfter} (an hour),
     * with forget_consumer.lua, never with a bare XGROUP DELCONSUMER (section 5). Throws
     * {@link Liveness.Waited} when a look at a liveness key waited for Redis.
     */
    @SuppressWarnings("unchecked")
    int forgetDeadConsumers() {
        long idleMs = Math.max(cfg.forgetAfter.toMillis(), cfg.leaseMs);
        int forgotten = 0;
        for (String stream : allStreams()) {
            List<Object> consumers;
            try {
                consumers = redis().xinfoConsumers(stream, cfg.group);
            } catch (RedisException e) {
                continue;
            }
            for (Object c : consumers) {
                List<Object> info = (List<Object>) c;
                Map<String, Object> kv = new HashMap<>();
                for (int i = 0; i + 1 < info.size(); i += 2) {
                    kv.put(Redis.s(info.get(i)), info.get(i + 1));
                }
                String name = Redis.s(kv.get("name"));
                long pending = kv.get("pending") instanceof Number ? ((Number) kv.get("pending")).longValue() : 1;
                long idle = kv.get("idle") instanceof Number ? ((Number) kv.get("idle")).longValue() : 0;
                if (name == null || name.equals(consumer) || pending > 0 || idle < idleMs
                        || liveness.alive(name)) {
                    continue;
                }
                Long r = Scripts.run(redis(), "forget_consumer", ScriptOutputType.INTEGER, List.of(stream), cfg.group,
                        name, idleMs);
                if (r != null && r == 1) {
                    forgotten++;
                    LOG.info("forgot dead consumer {} of {} that held nothing (idle {} ms)", name, stream, idle);
                }
            }
        }
        return forgotten;
    }

    // --- reading ----------------------------------------------------------------------------

    /** The task streams of every queue consumed. */
    private List<String> allStreams() {
        return queues.stream().flatMap(q -> keys.taskStreams(q).stream()).toList();
    }

    private void ensureGroups() {
        for (String stream : allStreams()) {
            try {
                redis().xgroupCreate(XReadArgs.StreamOffset.from(stream, "0"), cfg.group,
                        XGroupCreateArgs.Builder.mkstream(true));
            } catch (RedisBusyException e) {
                // BUSYGROUP: it exists
            } catch (RedisException e) {
                if (!String.valueOf(e.getMessage()).startsWith("BUSYGROUP")) {
                    throw e;
                }
            }
        }
    }

    private void runLoop() {
        long backoff = 100;
        while (!stopping.get()) {
            try {
                int n = credit.availablePermits();
                if (n == 0) {
                    if (credit.tryAcquire(200, TimeUnit.MILLISECONDS)) {
                        credit.release();
                    }
                    continue;
                }
                if (recoverPending) {
                    List<Entry> own = ownPending();
                    recoverPending = false;
                    if (!own.isEmpty()) {
                        LOG.warn("delivering {} entries this consumer had read but not settled", own.size());
                        dispatch(own);
                        continue;
                    }
                }
                List<Entry> batch = read(n);
                if (batch.isEmpty()) {
                    waitForEntries();
                    continue;
                }
                dispatch(batch);
                backoff = 100;
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
                return;
            } catch (RuntimeException e) {
                if (stopping.get()) {
                    return;
                }
                // A read whose reply was lost may have taken entries: look at our own pending ones next.
                recoverPending = true;
                link.recover(e);
                blockLinks.values().forEach(l -> l.recover(e));
                String m = String.valueOf(e.getMessage());
                if (m.contains("NOGROUP") || m.contains("no such key")) {
                    LOG.warn("consumer group missing (Redis lost its data?); creating it again");
                    try {
                        ensureGroups();
                    } catch (RuntimeException ignored) {
                        // retried below
                    }
                } else if (Redis.isOutage(e)) {
                    LOG.warn("Redis unreachable or failing over; reading again: {}", e.toString());
                } else {
                    LOG.warn("reading failed; retrying: {}", e.toString());
                }
                try {
                    Thread.sleep(backoff);
                } catch (InterruptedException ie) {
                    return;
                }
                backoff = Math.min(backoff * 2, 2000);
            }
        }
    }

    /** An entry read from a stream of {@code queue}. */
    private record Entry(String queue, String stream, String id, Map<String, byte[]> fields) {}

    /**
     * What read.lua last said of a queue: how soon to read it again (-1: no hurry), whether it has
     * limits, and the id of slot-freed to wait on from while entries wait for a slot ("": none do).
     */
    private record ReadState(long waitMs, boolean limited, String freedAfter) {
        static final ReadState UNKNOWN = new ReadState(-1, false, "");
    }

    private ReadState readState(String queue) {
        return readStates.getOrDefault(queue, ReadState.UNKNOWN);
    }

    /** At most {@code n} new entries: read.lua queue by queue, in order, with the credit left (one slot per call). */
    private List<Entry> read(int n) {
        List<Entry> out = new ArrayList<>();
        for (String queue : queues) {
            if (out.size() >= n) {
                break;
            }
            read(queue, n - out.size(), out);
        }
        return out;
    }

    /**
     * Up to {@code n} new entries of {@code queue} with read.lua; {@code n} is also the free run
     * capacity it may fill with entries of limited task types (no entry waits in a prefetch here).
     */
    private void read(String queue, int n, List<Entry> out) {
        ReadReply reply = ReadReply.parse(Scripts.run(redis(), "read", ScriptOutputType.MULTI, keys.taskStreams(queue),
                cfg.group, consumer, n, cfg.leaseMs, n));
        readStates.put(queue, new ReadState(reply.waitMs(), reply.limited(), reply.freedAfter()));
        for (ReadReply.StreamEntry m : reply.entries()) {
            out.add(new Entry(queue, m.stream(), m.id(), m.fields()));
        }
    }

    /** Entries pending for this consumer that it is not running (XREADGROUP ... 0, queue by queue). */
    @SuppressWarnings("unchecked")
    private List<Entry> ownPending() {
        List<Entry> out = new ArrayList<>();
        for (String queue : queues) {
            XReadArgs.StreamOffset<String>[] offsets = keys.taskStreams(queue).stream()
                    .map(st -> XReadArgs.StreamOffset.from(st, "0")).toArray(XReadArgs.StreamOffset[]::new);
            for (StreamMessage<String, byte[]> m : redis().xreadgroup(Consumer.from(cfg.group, consumer), offsets)) {
                if (!inFlightIds.contains(m.getStream() + " " + m.getId())) {
                    Map<String, byte[]> body = m.getBody();
                    out.add(new Entry(queue, m.getStream(), m.getId(),
                            body == null ? Map.of() : new LinkedHashMap<>(body)));
                }
            }
        }
        return out;
    }

    /**
     * Waits until a queue may have entries: one XREAD BLOCK per queue, on its own connection, from
     * the group's last-delivered ids (then read.lua takes exactly the credit). A wait still under
     * way from the last round goes on; an error of one ends the round with that error. While a
     * queue has parked entries the round ends within the wait read.lua asked for (section 19):
     * a rate token due wakes no XREAD. A slot freed does: while entries wait for one, the
     * queue's wait includes slot-freed.
     */
    private void waitForEntries() throws InterruptedException {
        List<CompletableFuture<Void>> all = new ArrayList<>();
        long soonest = -1;
        for (String queue : queues) {
            long waitMs = readState(queue).waitMs();
            if (waitMs >= 0) {
                soonest = soonest < 0 ? waitMs : Math.min(soonest, waitMs);
            }
            CompletableFuture<Void> w = waits.get(queue);
            if (w == null || w.isDone()) {
                Duration block = waitMs >= 0 ? Duration.ofMillis(Math.max(1, Math.min(waitMs, cfg.block.toMillis())))
                        : cfg.block;
                String freedAfter = readState(queue).freedAfter();
                w = CompletableFuture.runAsync(() -> waitOn(queue, block, freedAfter), waiters);
                waits.put(queue, w);
            }
            all.add(w);
        }
        try {
            CompletableFuture.anyOf(all.toArray(new CompletableFuture[0]))
                    .get(soonest >= 0 ? Math.max(1, soonest) : cfg.block.toMillis() + 4000, TimeUnit.MILLISECONDS);
        } catch (ExecutionException e) {
            throw e.getCause() instanceof RuntimeException r ? r : new IllegalStateException(e.getCause());
        } catch (TimeoutException e) {
            // every wait still blocked: read again
        }
    }

    /**
     * One XREAD BLOCK of at most {@code block} on the streams of {@code queue} (one slot), on that
     * queue's connection, and on its slot-freed from {@code freedAfter} unless that is empty.
     */
    @SuppressWarnings("unchecked")
    private void waitOn(String queue, Duration block, String freedAfter) {
        List<XReadArgs.StreamOffset<String>> offsets = new ArrayList<>();
        for (String stream : keys.taskStreams(queue)) {
            String last = "0-0";
            for (Object g : redis().xinfoGroups(stream)) {
                List<Object> info = (List<Object>) g;
                Map<String, String> kv = new HashMap<>();
                for (int i = 0; i + 1 < info.size(); i += 2) {
                    kv.put(Redis.s(info.get(i)), Redis.s(info.get(i + 1)));
                }
                if (cfg.group.equals(kv.get("name"))) {
                    last = kv.getOrDefault("last-delivered-id", "0-0");
                }
            }
            offsets.add(XReadArgs.StreamOffset.from(stream, last));
        }
        if (!freedAfter.isEmpty()) {
            offsets.add(XReadArgs.StreamOffset.from(keys.slotFreed(queue), freedAfter));
        }
        List<StreamMessage<String, byte[]>> ignored = blockLinks.get(queue).sync().xread(
                XReadArgs.Builder.block(block).count(1), offsets.toArray(new XReadArgs.StreamOffset[0]));
    }

    private void dispatch(List<Entry> batch) throws InterruptedException {
        List<Envelope> envs = new ArrayList<>(batch.size());
        List<MalformedEntryException> errors = new ArrayList<>(batch.size());
        List<String> ids = new ArrayList<>();
        for (Entry e : batch) {
            try {
                Envelope env = EntryCodec.decodeEntry(e.fields(), cfg.limits);
                envs.add(env);
                errors.add(null);
                ids.add(env.taskId());
            } catch (MalformedEntryException ex) {
                envs.add(null);
                errors.add(ex);
            }
        }
        Set<String> cancelled = cancelledAmong(ids);
        for (int i = 0; i < batch.size(); i++) {
            Entry e = batch.get(i);
            Envelope env = envs.get(i);
            MalformedEntryException err = errors.get(i);
            credit.acquire();
            inFlight.incrementAndGet();
            String key = e.stream() + " " + e.id();
            inFlightIds.add(key);
            holdSlot(e, env);
            pool.execute(() -> {
                try {
                    process(e, env, err, env != null && cancelled.contains(env.taskId()));
                } catch (RuntimeException ex) {
                    LOG.error("handling entry {} failed; it stays pending", e.id(), ex);
                } finally {
                    MDC.clear();
                    slots.release(e.stream(), e.id());
                    inFlightIds.remove(key);
                    inFlight.decrementAndGet();
                    credit.release();
                }
            });
        }
    }

    /**
     * Notes the concurrency slot entry {@code e} may hold when its queue has limits: its task type
     * is field {@code t}, else the Envelope's when {@code enc} is {@code json} (section 19); an
     * entry with neither holds none.
     */
    private void holdSlot(Entry e, Envelope env) {
        if (!readState(e.queue()).limited()) {
            return;
        }
        byte[] t = e.fields().get("t");
        String type = t != null ? Redis.s(t)
                : env != null && "json".equals(Redis.s(e.fields().get("enc"))) ? env.taskType() : null;
        if (type != null) {
            slots.hold(e.queue(), e.stream(), e.id(), type);
        }
    }

    private Set<String> cancelledAmong(List<String> ids) {
        if (ids.isEmpty()) {
            return Set.of();
        }
        try {
            byte[][] members = ids.stream().map(Redis::b).toArray(byte[][]::new);
            List<Double> scores = redis().zmscore(keys.cancelled(), members);
            java.util.HashSet<String> out = new java.util.HashSet<>();
            for (int i = 0; i < ids.size(); i++) {
                if (scores.get(i) != null) {
                    out.add(ids.get(i));
                }
            }
            return out;
        } catch (RuntimeException e) {
            LOG.warn("looking up cancel marks failed: {}", e.toString());
            return Set.of();
        }
    }

    // --- one entry (section 5.1) ---------------------------------------------------------------

    private void process(Entry e, Envelope env, MalformedEntryException malformed, boolean cancelled) {
        MDC.put("queue", e.queue());
        MDC.put("entry_id", e.id());
        if (env == null) {
            LOG.error("malformed entry {} in {}: {}", e.id(), e.stream(), malformed.getMessage());
            deadLetter(e, null, new Failure("malformed_entry", malformed.kind() + ": " + malformed.getMessage(),
                    null, null, null, 0, null, null));
            return;
        }
        MDC.put("trace_id", env.traceId());
        MDC.put("task_id", env.taskId());
        MDC.put("task_type", env.taskType());
        Instant now = Instant.now();
        if (!env.isDue(now)) {
            reschedule(e, env);
            return;
        }
        if (cancelled) {
            results.report(env, () -> CeleryResults.revoked(env.taskId(), "revoked"));
            ack(e, env, "cancelled", "cancelled");
            LOG.info("task cancelled; acknowledged without running (outcome=cancelled)");
            return;
        }
        if (env.isExpired(now)) {
            results.report(env, () -> CeleryResults.revoked(env.taskId(), "expired"));
            ack(e, env, "cancelled", "expired");
            LOG.info("task expired at {}; acknowledged without running (outcome=expired)", env.expires());
            return;
        }
        Handler h = handlers.get(env.taskType());
        if (h == null) {
            deadLetter(e, env, notRun(env, "unknown_task_type",
                    "no handler for task_type \"" + env.taskType() + "\" in this worker"));
            return;
        }
        if (!h.versions.contains(env.payloadVersion())) {
            deadLetter(e, env, notRun(env, "unsupported_payload_version",
                    "payload_version " + env.payloadVersion() + " is not accepted (accepted: " + h.versions + ")"));
            return;
        }
        List<SchemaViolation> broken = schemaViolations(env);
        if (!broken.isEmpty()) {
            stats.count(e.queue(), env.taskType(), WorkerStats.Outcome.FAILED);
            deadLetter(e, env, notRun(env, "invalid_payload", PayloadSchemas.deadLetterReason(broken)));
            return;
        }
        int redeliveries = intField(e, "n") + intField(e, "r");
        Task task = new Task(env, e.queue(), e.stream(), e.id(), redeliveries);
        if (env.idempotencyKey() == null) {
            runAttempt(e, env, h, task, null);
            return;
        }
        String key = keys.idempotency(env.taskType(), env.idempotencyKey());
        if (!claiming.add(key)) {
            LOG.info("another attempt of this idempotency key runs here; deferred");
            deferNow(e, env);
            return;
        }
        boolean kept = false;
        try {
            String holder = claim(e, env, key);
            kept = holder != null && runAttempt(e, env, h, task, holder);
        } finally {
            if (!kept) {
                claiming.remove(key);
            }
        }
    }

    /**
     * Runs the task, its idempotency key claimed by {@code holder} (null: it has none), and settles
     * it; answers whether an abandoned attempt keeps the claim, and so its mark, until it returns.
     */
    private boolean runAttempt(Entry e, Envelope env, Handler h, Task task, String holder) {
        String slot = null;
        if (env.retryCount() > 0 && env.asksForTieredRetries()) {
            slot = keys.retrying(env.taskType());
            long hold = env.timeoutMs() != null ? env.timeoutMs() : 15 * 60 * 1000L;
            try {
                Long got = Scripts.run(redis(), "retry_slot", ScriptOutputType.INTEGER, List.of(slot), env.taskId(),
                        cfg.retryConcurrency, hold);
                if (got != null && got == 0) {
                    if (holder != null) {
                        finishIdem(env, holder, "release");
                    }
                    Duration delay = cfg.retryPolicy.backoffDelay(env.retryCount(), RetryPolicy.fastRetriesTaken(env));
                    LOG.info("retry slots of {} are all taken; rescheduled in {} ms", env.taskType(), delay.toMillis());
                    replace(e, env, deferred(env, delay), delay, "scheduled", null);
                    return false;
                }
            } catch (RuntimeException ex) {
                LOG.warn("retry slot check failed; running anyway: {}", ex.toString());
                slot = null;
            }
        }
        Tracing.Attempt span = tracing.process(e.queue(), env);
        try {
            recordStart(e, env);
            LOG.info("task started: retry_count={} redelivered={}", env.retryCount(), task.redeliveries());
            Timestamp since = env.scheduleTime() != null ? env.scheduleTime() : env.createdAt();
            stats.waited(e.queue(), env.taskType(), Duration.between(since.toInstant(), Instant.now()).toNanos());
            long started = System.nanoTime();
            Attempt attempt = run(h.handler, task, span);
            long took = System.nanoTime() - started;
            stats.ran(e.queue(), env.taskType(), took);
            long ms = took / 1_000_000;
            Throwable err = attempt.error();
            JsonNode value = null;
            if (err == null && CeleryResults.asksForResult(env)) {
                try {
                    value = CeleryResults.encode(attempt.value());
                } catch (CeleryResults.EncodeError ex) {
                    err = ex;
                }
            }
            if (err == null) {
                if (holder != null) {
                    finishIdem(env, holder, "done");
                }
                JsonNode result = value;
                results.report(env, () -> CeleryResults.success(env.taskId(), result));
                stats.count(e.queue(), env.taskType(), WorkerStats.Outcome.SUCCEEDED);
                ack(e, env, "succeeded", null);
                LOG.info("task succeeded (outcome=success duration_ms={})", ms);
                return false;
            }
            stats.count(e.queue(), env.taskType(), WorkerStats.Outcome.FAILED);
            span.fail(err);
            boolean kept = holder != null && attempt.stillRunning() != null;
            if (kept) {
                keepClaimUntilReturned(env, holder, attempt.stillRunning());
            } else if (holder != null) {
                finishIdem(env, holder, "release");
            }
            fail(e, env, err);
            return kept;
        } finally {
            span.end();
            if (slot != null) {
                String s = slot;
                settle("release retry slot", () -> redis().zrem(s, Redis.b(env.taskId())));
            }
        }
    }

    /**
     * The ways the payload breaks its schema (section 16); none when the schemas cannot be read
     * (Redis failing): the task then runs unchecked.
     */
    private List<SchemaViolation> schemaViolations(Envelope env) {
        try {
            return schemas.violations(env);
        } catch (RuntimeException ex) {
            link.recover(ex);
            LOG.warn("reading the payload schemas failed; the task runs unchecked: {}", ex.toString());
            return List.of();
        }
    }

    /** The record of a start: state running, attempts + 1 and who runs it, one MULTI; a failure is logged. */
    private void recordStart(Entry e, Envelope env) {
        Map<String, String> fields = new LinkedHashMap<>();
        fields.put("started_at", TaskRecords.time(Instant.now()));
        fields.put("worker", consumer);
        fields.put("language", LANGUAGE);
        fields.put("host", host);
        fields.put("pid", pid);
        TaskRecords.Step record = records.activeStep(e.queue(), env.taskId(), 0, fields);
        if (record == TaskRecords.Step.NONE) {
            return;
        }
        try {
            txLink.transaction(record.key(), tx -> record.write(tx, "running", true));
        } catch (RuntimeException ex) {
            txLink.recover(ex);
            LOG.warn("writing the task record of the start failed: {}", ex.toString());
        }
    }

    private static int intField(Entry e, String name) {
        byte[] v = e.fields().get(name);
        if (v == null) {
            return 0;
        }
        try {
            return Integer.parseInt(Redis.s(v));
        } catch (NumberFormatException ex) {
            return 0;
        }
    }

    /** An attempt that exceeded timeout_ms. */
    static final class AttemptTimeout extends Exception {
        private static final long serialVersionUID = 1L;

        AttemptTimeout(long ms) {
            super("attempt exceeded timeout_ms " + ms);
        }
    }

    /**
     * How an attempt ended: the handler's value, or the failure (then not null). {@code stillRunning}
     * is set when the handler was abandoned: it completes when the handler really returns.
     */
    private record Attempt(Object value, Throwable error, CompletableFuture<Object> stillRunning) {}

    /**
     * Runs the handler within timeout_ms, interrupting it at the deadline, in the task's trace:
     * its trace id, its {@code traceparent} and the context of its {@code process} span current.
     */
    private Attempt run(ResultHandler handler, Task task, Tracing.Attempt span) {
        Map<String, String> mdc = MDC.getCopyOfContextMap();
        Map<String, String> headers = task.envelope().headers();
        HandlerCall call = HandlerCall.start(handlerThreads, () -> {
            if (mdc != null) {
                MDC.setContextMap(mdc);
            }
            try (TraceContext.Scope trace = TraceContext.with(task.traceId(), headers.get(Tracing.TRACEPARENT),
                    headers.get(Tracing.TRACESTATE)); Scope current = span.context().makeCurrent()) {
                return handler.handle(task);
            } finally {
                MDC.clear();
            }
        });
        Long timeout = task.envelope().timeoutMs();
        try {
            return new Attempt(call.await(timeout), null, null);
        } catch (TimeoutException ex) {
            call.stop();
            LOG.warn("attempt exceeded timeout_ms {}; abandoned", timeout);
            return new Attempt(null, new AttemptTimeout(timeout), call.returned());
        } catch (ExecutionException ex) {
            return new Attempt(null, ex.getCause(), null);
        } catch (InterruptedException ex) {
            call.stop();
            Thread.currentThread().interrupt();
            return new Attempt(null, ex, call.returned());
        }
    }

    // --- idempotency (section 9) ------------------------------------------------------------

    /** Hands the entry back unrun, the same Envelope due {@code deferDelay} later (a deferral, section 8). */
    private void deferNow(Entry e, Envelope env) {
        replace(e, env, deferred(env, cfg.deferDelay), cfg.deferDelay, "scheduled", null);
    }

    /**
     * Claims the idempotency key {@code key}, marked for this attempt; answers the holder when the
     * task should run, else null (the entry is settled or handed back, the claim released).
     */
    @SuppressWarnings("unchecked")
    private String claim(Entry e, Envelope env, String key) {
        String holder = consumer + " " + env.taskId();
        long claimFor = claimTime(env);
        String replace = "";
        for (int round = 0; round < 2; round++) {
            List<Object> res;
            try {
                String replacing = replace;
                res = link.write(key, node -> Scripts.run(node, "idem_begin", ScriptOutputType.MULTI, List.of(key),
                        holder, claimFor, replacing));
            } catch (RuntimeException ex) {
                // The claim may have landed all the same (a lost reply, a failed WAIT): under the
                // key's mark no other attempt here holds it, so the release undoes only this one.
                LOG.warn("idempotency claim failed; releasing it and handing the entry back: {}", ex.toString());
                link.recover(ex);
                settleClaim(key, holder, "release");
                deferNow(e, env);
                return null;
            }
            String answer = Redis.s(res.get(0));
            if ("acquired".equals(answer)) {
                return holder;
            }
            if ("done".equals(answer)) {
                stats.count(e.queue(), env.taskType(), WorkerStats.Outcome.DUPLICATE);
                results.report(env, () -> CeleryResults.success(env.taskId(), null));
                ack(e, env, "succeeded", "duplicate");
                LOG.info("duplicate: the effect already happened; acknowledged without running "
                        + "(outcome=duplicate idempotency_key={} marker={})", env.idempotencyKey(), Redis.s(res.get(1)));
                if (cfg.onDuplicate != null) {
                    cfg.onDuplicate.accept(env);
                }
                return null;
            }
            if ("busy".equals(answer)) {
                String other = Redis.s(res.get(1));
                // The consumer is the holder's first word (protocol.md section 9: a Celery
                // worker's holder names the entry too).
                int sp = other.indexOf(' ');
                String owner = sp >= 0 ? other.substring(0, sp) : other;
                if (round == 0 && holderGone(owner)) {
                    LOG.warn("idempotency holder {} is dead; taking the claim over", other);
                    replace = other;
                    continue;
                }
                LOG.info("another consumer runs this idempotency key ({}); deferred", other);
                break;
            }
            break;
        }
        deferNow(e, env);
        return null;
    }

    /**
     * Whether the holder of a busy claim is dead, looked at twice one renewal interval apart
     * (section 9); a look that waited for Redis or failed, or an interruption, answers no.
     */
    private boolean holderGone(String owner) {
        try {
            return liveness.holderGone(owner);
        } catch (Liveness.Waited ex) {
            LOG.warn("the idempotency holder's liveness is not trusted: {}", ex.getMessage());
        } catch (InterruptedException ex) {
            Thread.currentThread().interrupt();
        } catch (RuntimeException ex) {
            LOG.warn("looking at the idempotency holder's liveness key failed: {}", ex.toString());
        }
        return false;
    }

    /** How long an idempotency claim of {@code env} lasts unless renewed, in ms. */
    private long claimTime(Envelope env) {
        return env.timeoutMs() != null ? env.timeoutMs() + cfg.leaseMs : 3_600_000L;
    }

    /**
     * Keeps the claim of an abandoned attempt until its handler really returns, renewing it every
     * third of the claim time with idem_begin.lua (re-entrant for its holder), then settles it
     * with {@code done} or {@code release} as the handler ended (section 8).
     */
    private void keepClaimUntilReturned(Envelope env, String holder, CompletableFuture<Object> stillRunning) {
        String key = keys.idempotency(env.taskType(), env.idempotencyKey());
        long claimFor = claimTime(env);
        Map<String, String> mdc = MDC.getCopyOfContextMap();
        LOG.info("the abandoned attempt keeps its idempotency claim until its handler returns");
        abandoned.keep(key, Duration.ofMillis(claimFor / 3), () -> {
            List<Object> res = Scripts.run(redis(), "idem_begin", ScriptOutputType.MULTI, List.of(key), holder, claimFor, "");
            if (!"acquired".equals(Redis.s(res.get(0)))) {
                LOG.warn("an abandoned attempt of {} lost its idempotency claim: {} {}", env.taskId(),
                        Redis.s(res.get(0)), res.size() > 1 ? Redis.s(res.get(1)) : "");
            }
        }, stillRunning, returnedNormally -> {
            Map<String, String> before = MDC.getCopyOfContextMap();
            if (mdc != null) {
                MDC.setContextMap(mdc);
            }
            try {
                String how = returnedNormally ? "done" : "release";
                LOG.info("an abandoned attempt returned; its idempotency claim is settled with {}", how);
                finishIdem(env, holder, how);
            } finally {
                claiming.remove(key);
                if (before != null) {
                    MDC.setContextMap(before);
                } else {
                    MDC.clear();
                }
            }
        });
    }

    /** Settles the claim of {@code env} that ran (or was kept) with {@code how}; 0 means it was taken over. */
    private void finishIdem(Envelope env, String holder, String how) {
        Long n = settleClaim(keys.idempotency(env.taskType(), env.idempotencyKey()), holder, how);
        if (n != null && n == 0) {
            LOG.warn("the idempotency claim had been taken over: the task may have run twice");
        }
    }

    /**
     * idem_finish.lua {@code how} ({@code done} or {@code release}) on {@code key} for {@code holder},
     * then the WAIT of the claim, retried while Redis is away; its answer, null when given up.
     */
    private Long settleClaim(String key, String holder, String how) {
        return settle("idem_finish " + how, () -> link.write(key, node -> Scripts.run(node, "idem_finish",
                ScriptOutputType.INTEGER, List.of(key), holder, how, cfg.idemDoneTtl.toMillis(),
                Timestamp.now().toString())));
    }

    // --- failures and retries (section 8) ---------------------------------------------------

    /**
     * Why an entry is dead-lettered; {@code exceptionType}, {@code message} and {@code traceback}
     * are those of the handler's error, null when none caused it.
     */
    private record Failure(String failureClass, String reason, String exceptionType, String message,
                           String traceback, long attempts, Timestamp firstFailure, Timestamp lastFailure) {}

    private static Timestamp firstFailure(Envelope env) {
        String h = env.headers().get("x-first-failure-at");
        if (h != null) {
            try {
                return Timestamp.parse(h);
            } catch (IllegalArgumentException ignored) {
                // not a time: the first failure is now
            }
        }
        return Timestamp.now();
    }

    private Failure notRun(Envelope env, String cls, String reason) {
        return new Failure(cls, reason, null, null, null, env.retryCount() + 1, firstFailure(env), Timestamp.now());
    }

    private boolean isTransient(Throwable err) {
        if (err instanceof TaskFailure.Transient) {
            return true;
        }
        if (err instanceof java.net.ConnectException || err instanceof java.net.SocketTimeoutException
                || err instanceof io.lettuce.core.RedisConnectionException) {
            return true;
        }
        return cfg.isTransient != null && cfg.isTransient.test(err);
    }

    private void fail(Entry e, Envelope env, Throwable err) {
        Timestamp first = firstFailure(env);
        Timestamp now = Timestamp.now();
        String type = err instanceof CeleryResults.EncodeError ? CeleryResults.EncodeError.TYPE : err.getClass().getName();
        String trace = stackTrace(err);
        long attempts = env.retryCount() + 1;
        String message = Objects.toString(err.getMessage(), "");
        if (err instanceof TaskFailure.InvalidPayload || err instanceof TaskFailure.Rejected) {
            String cls = err instanceof TaskFailure.InvalidPayload ? "invalid_payload" : "rejected";
            LOG.error("task failed permanently (outcome=dead failure_class={}): {}", cls, message);
            deadLetter(e, env, new Failure(cls, message, type, message, trace, attempts, first, now));
            return;
        }
        if (err instanceof TaskFailure.Retry) {
            TaskFailure.Retry r = (TaskFailure.Retry) err;
            long next = env.retryCount() + 1;
            if (env.maxRetries() != null && next > env.maxRetries()) {
                String cls = r.getCause() != null && isTransient(r.getCause()) ? "transient_exhausted" : "task_error";
                deadLetter(e, env, new Failure(cls, "gave up after " + next + " attempts (max_retries "
                        + env.maxRetries() + "): " + message, type, message, trace, next, first, now));
                return;
            }
            Envelope.Builder b = env.toBuilder().retryCount(next)
                    .scheduleTime(r.countdown().isZero() ? null : Timestamp.of(Instant.now().plus(r.countdown())));
            if (!env.headers().containsKey("x-first-failure-at")) {
                b.header("x-first-failure-at", first.toString());
            }
            LOG.warn("task asked for a retry in {} ms (outcome=retry retry_count={}): {}",
                    r.countdown().toMillis(), next, message);
            retry(e, env, b.build(), r.countdown(), TaskRecords.error(type, message));
            return;
        }
        RetryPolicy.Kind kind = err instanceof AttemptTimeout ? RetryPolicy.Kind.TIMEOUT
                : isTransient(err) ? RetryPolicy.Kind.TRANSIENT : RetryPolicy.Kind.TASK_ERROR;
        RetryPolicy.Decision d = cfg.retryPolicy.decide(env, kind);
        if (d.action() == RetryPolicy.Action.DEAD_LETTER) {
            LOG.error("task failed (outcome=dead failure_class={} attempts={}): {}", d.failureClass(), d.next(), message);
            deadLetter(e, env, new Failure(d.failureClass(), d.message() + ": " + message, type, message, trace,
                    d.next(), first, now));
            return;
        }
        Envelope.Builder b = env.toBuilder().retryCount(d.next());
        if (d.fastRetries() > 0) {
            b.header("x-fast-retries", String.valueOf(d.fastRetries()));
        }
        b.scheduleTime(d.delay().isZero() ? null : Timestamp.of(Instant.now().plus(d.delay())));
        if (!env.headers().containsKey("x-first-failure-at")) {
            b.header("x-first-failure-at", first.toString());
        }
        LOG.warn("task failed; retrying (outcome=retry retry_count={} delay_ms={}): {}", d.next(),
                d.delay().toMillis(), message);
        retry(e, env, b.build(), d.delay(), TaskRecords.error(type, message));
    }

    /** Writes the next attempt {@code next} (retry_count + 1) with retry.lua and counts the retry. */
    private void retry(Entry e, Envelope env, Envelope next, Duration delay, String error) {
        if (replace(e, env, next, delay, "retrying", error)) {
            stats.count(e.queue(), env.taskType(), WorkerStats.Outcome.RETRIED);
        }
    }

    private static String stackTrace(Throwable t) {
        StringWriter w = new StringWriter();
        t.printStackTrace(new PrintWriter(w));
        String s = w.toString();
        return s.length() > 16_000 ? s.substring(0, 16_000) : s;
    }

    /** {@code env} pushed back by {@code delay}, retry_count unchanged. */
    private static Envelope deferred(Envelope env, Duration delay) {
        return env.toBuilder().scheduleTime(delay.isZero() ? null : Timestamp.of(Instant.now().plus(delay))).build();
    }

    /**
     * Swaps the pending entry for {@code next} atomically with retry.lua, its record in
     * {@code state} ({@code retrying} or {@code scheduled}; queued when due now) with {@code error}
     * (null for a deferral); answers whether retry.lua wrote it.
     */
    private boolean replace(Entry e, Envelope env, Envelope next, Duration delay, String state, String error) {
        EntryCodec.Body body;
        try {
            body = EntryCodec.encodeBody(next, cfg.gzipMin, cfg.limits);
        } catch (EnvelopeValidationException ex) {
            deadLetter(e, env, new Failure("task_error", "cannot write the next attempt: " + ex.getMessage(), null,
                    null, null, env.retryCount() + 1, null, null));
            return false;
        }
        long due = next.scheduleTime() != null && !delay.isZero() ? next.scheduleTime().toEpochMilli() : 0;
        String bucket = Keys.bucketFor(next.priority());
        String queue = e.queue();
        if (due > 0) {
            registerDelayed(queue);
        }
        Map<String, String> fields = new LinkedHashMap<>();
        fields.put("state", state);
        fields.put("retry_count", String.valueOf(next.retryCount()));
        if (due > 0) {
            fields.put("due_at", TaskRecords.time(Instant.ofEpochMilli(due)));
        }
        if (error != null) {
            fields.put("error", error);
        }
        TaskRecords.Step record = records.activeStep(queue, next.taskId(), due, fields);
        Long written = settle("retry.lua", () -> {
            Long r = link.write(e.stream(), node -> Scripts.run(node, "retry", ScriptOutputType.INTEGER,
                    record.keys(List.of(e.stream(), keys.stream(queue, bucket), keys.delayed(queue),
                            keys.delayedData(queue))),
                    record.args(8, cfg.group, e.id(), next.taskId(), due, bucket, body.enc(), body.bytes(),
                            keys.wakeup())));
            if (r == null) {
                LOG.warn("entry was no longer pending when replaced (taken over?)");
            }
            return r;
        });
        return written != null;
    }

    /** {@code SADD <prefix>:queues}, on its own, before a delayed store (section 2, registries). */
    private void registerDelayed(String queue) {
        settle("register the queue", () -> redis().sadd(keys.queues(), Redis.b(queue)));
    }

    /**
     * Moves a not-yet-due entry to the delayed set byte for byte, with token entry:<id>: the
     * registry first, then schedule.lua and the acknowledgement in one MULTI (one queue, one slot;
     * the script goes as EVAL, since a MULTI cannot fall back from NOSCRIPT).
     */
    private void reschedule(Entry e, Envelope env) {
        String bucket = Keys.bucketFor(env.priority());
        byte[] enc = e.fields().get("enc");
        byte[] body = e.fields().get("body");
        String queue = e.queue();
        long due = env.dueMs(0);
        Map<String, String> fields = TaskRecords.published(env, queue);
        fields.put("due_at", TaskRecords.time(Instant.ofEpochMilli(due)));
        TaskRecords.Step record = records.activeStep(queue, env.taskId(), due, fields);
        Object[] args = record.args(8, env.taskId(), due, bucket, enc, body, keys.wakeup(), "entry:" + e.id(),
                Producer.PUBLISH_DEDUPE_MS);
        byte[][] argv = java.util.Arrays.stream(args).map(Scripts::arg).toArray(byte[][]::new);
        registerDelayed(queue);
        settle("reschedule", () -> txLink.transaction(e.stream(), tx -> {
            tx.eval(Scripts.get("schedule").source(), ScriptOutputType.INTEGER,
                    record.keys(List.of(keys.delayed(queue), keys.delayedData(queue), keys.published(queue,
                            env.taskId()))).toArray(new String[0]), argv);
            tx.xack(e.stream(), cfg.group, e.id());
            tx.xdel(e.stream(), e.id());
            freeSlot(e, tx);
        }));
        LOG.info("task not due yet; moved to the delayed set (outcome=scheduled schedule_time={})", env.scheduleTime());
    }

    /**
     * Acknowledges a task that ended in {@code state} ({@code succeeded} or {@code cancelled}, with
     * {@code reason}: null for a plain success), its record written in the same MULTI. Settled for
     * good, a task with an {@code ordering_key} moves its key on in that MULTI, then wakes the
     * promoters to release the key's next task (section 20).
     */
    private void ack(Entry e, Envelope env, String state, String reason) {
        Map<String, String> fields = new LinkedHashMap<>();
        fields.put("finished_at", TaskRecords.time(Instant.now()));
        if (reason != null) {
            fields.put("reason", reason);
        }
        TaskRecords.Step record = records.finalStep(e.queue(), env.taskId(), fields);
        boolean keyed = env.orderingKey() != null;
        TransactionResult acked = settle("ack", () -> {
            TransactionResult r = txLink.transaction(e.stream(), tx -> {
                tx.xack(e.stream(), cfg.group, e.id());
                tx.xdel(e.stream(), e.id());
                freeSlot(e, tx);
                if (keyed) {
                    advanceKey(e.queue(), env, tx);
                }
                record.write(tx, state, false);
            });
            Object n = r.isEmpty() ? null : r.get(0);
            if (n instanceof Long && (Long) n == 0) {
                LOG.warn("ack answered 0: the entry was taken over while this consumer looked dead");
            }
            return r;
        });
        if (keyed && acked != null) {
            wakePromoters();
        }
    }

    /**
     * Adds to a final acknowledgement's MULTI what moves the ordering key of {@code env} on
     * (section 20): {@code LREM} of its task_id from the key's order and {@code RPUSH} of the key
     * to {@code order-advanced}, for promote.lua to release the next task.
     */
    private void advanceKey(String queue, Envelope env, io.lettuce.core.api.sync.RedisCommands<String, byte[]> tx) {
        tx.lrem(keys.order(queue, env.orderingKey()), 1, Redis.b(env.taskId()));
        tx.rpush(keys.orderAdvanced(queue), Redis.b(env.orderingKey()));
    }

    /**
     * {@code PUBLISH <prefix>:wakeup 0} after a key moved on, so a sleeping promoter releases its next
     * task now; best effort: a failure is logged, and promoters release it at their next look.
     */
    private void wakePromoters() {
        try {
            redis().publish(keys.wakeup(), Redis.b("0"));
        } catch (RuntimeException ex) {
            link.recover(ex);
            LOG.warn("waking the promoters failed; they release the next task of the key at their next look: {}",
                    ex.toString());
        }
    }

    /** Adds the ZREM that frees the concurrency slot of {@code e}, if it may hold one, to its acknowledgement's MULTI. */
    private void freeSlot(Entry e, io.lettuce.core.api.sync.RedisCommands<String, byte[]> tx) {
        Slots.Slot slot = slots.of(e.stream(), e.id());
        if (slot != null) {
            slot.free(tx);
        }
    }

    private void deadLetter(Entry e, Envelope env, Failure f) {
        Timestamp now = Timestamp.now();
        String queue = e.queue();
        List<Object> args = new ArrayList<>(List.of(cfg.group, e.id(),
                "dlq", "1",
                "failure_class", f.failureClass(),
                "reason", f.reason(),
                "queue", queue,
                "dead_at", now.toString(),
                "language", LANGUAGE,
                "host", host,
                "pid", pid,
                "consumer", consumer,
                "first_failure_at", (f.firstFailure() != null ? f.firstFailure() : now).toString(),
                "last_failure_at", (f.lastFailure() != null ? f.lastFailure() : now).toString()));
        if (f.exceptionType() != null) {
            args.addAll(List.of("exception_type", f.exceptionType()));
        }
        if (f.traceback() != null) {
            args.addAll(List.of("traceback", f.traceback()));
        }
        if (f.attempts() > 0) {
            args.addAll(List.of("attempts", String.valueOf(f.attempts())));
        }
        if (env != null) {
            args.addAll(List.of("task_id", env.taskId(), "task_type", env.taskType()));
            results.report(env, () -> CeleryResults.failure(env.taskId(),
                    f.exceptionType() != null ? f.exceptionType() : f.failureClass(),
                    f.message() != null && !f.message().isEmpty() ? f.message() : f.reason(), f.traceback()));
        }
        TaskRecords.Step record = TaskRecords.Step.NONE;
        if (env != null) {
            String error = f.exceptionType() != null && f.message() != null && !f.message().isEmpty()
                    ? TaskRecords.error(f.exceptionType(), f.message()) : TaskRecords.error(f.failureClass(), f.reason());
            Map<String, String> fields = new LinkedHashMap<>();
            fields.put("finished_at", TaskRecords.time(Instant.now()));
            fields.put("error", error);
            record = records.finalStep(queue, env.taskId(), fields);
        }
        Object[] a = record.args(2, args.toArray());
        List<String> deadKeys = record.keys(List.of(e.stream(), keys.dead(queue)));
        settle("register the dead-letter queue", () -> redis().sadd(keys.deadQueues(), Redis.b(queue)));
        Object id = settle("dead_letter.lua", () -> {
            byte[] r = link.write(e.stream(), node -> Scripts.run(node, "dead_letter", ScriptOutputType.VALUE,
                    deadKeys, a));
            if (r == null) {
                LOG.warn("entry was no longer pending when dead-lettered (taken over?)");
                return null;
            }
            return Redis.s(r);
        });
        if (id != null) {
            stats.count(queue, env != null ? env.taskType() : WorkerStats.UNDECODABLE, WorkerStats.Outcome.DEAD);
        }
        LOG.error("entry dead-lettered (outcome=dead failure_class={} dead_id={}): {}", f.failureClass(), id, f.reason());
    }

    // --- results for Celery callers (section 12) -------------------------------------------

    /**
     * The FAILURE result of an entry requeue.lua dead-lettered as {@code redelivery_limit}, read back
     * from its dead-letter entry (off the lease thread: the write may wait for the backend).
     */
    private void reportRedeliveryLimit(String queue, String deadId) {
        try {
            handlerThreads.execute(() -> {
                try {
                    List<StreamMessage<String, byte[]>> found = redis().xrange(keys.dead(queue), Range.create(deadId, deadId));
                    if (found.isEmpty()) {
                        return;
                    }
                    Map<String, byte[]> dead = found.get(0).getBody();
                    Map<String, byte[]> raw = new LinkedHashMap<>();
                    dead.forEach((k, v) -> {
                        if (k.startsWith("raw.")) {
                            raw.put(k.substring(4), v);
                        }
                    });
                    Envelope env = EntryCodec.decodeEntry(raw, cfg.limits);
                    results.report(env, () -> CeleryResults.failure(env.taskId(), "redelivery_limit",
                            Redis.s(dead.get("reason")), null));
                } catch (MalformedEntryException ex) {
                    // an entry that cannot be decoded names no result
                } catch (RuntimeException ex) {
                    LOG.error("writing the result of dead-letter entry {} failed: {}", deadId, ex.toString());
                }
            });
        } catch (java.util.concurrent.RejectedExecutionException ex) {
            LOG.warn("worker closing: the result of dead-letter entry {} is not written", deadId);
        }
    }

    /**
     * Runs a step that ends an entry's handling (every such step is safe to repeat): an outage or
     * failover is retried for the outage tolerance, finding the new primary, any other Redis error
     * ten times.
     */
    private <T> T settle(String what, java.util.function.Supplier<T> step) {
        long delay = 100;
        long deadline = System.nanoTime() + cfg.outageTolerance.toNanos();
        int otherErrors = 0;
        while (true) {
            try {
                return step.get();
            } catch (RuntimeException ex) {
                link.recover(ex);
                txLink.recover(ex);
                boolean outage = Redis.isOutage(ex);
                if (!outage) {
                    otherErrors++;
                }
                if (outage ? System.nanoTime() > deadline : otherErrors == 10) {
                    LOG.error("giving up on step {}; the entry stays pending: {}", what, ex.toString());
                    return null;
                }
                LOG.warn("step {} failed; retrying: {}", what, ex.toString());
                try {
                    Thread.sleep(delay);
                } catch (InterruptedException ie) {
                    Thread.currentThread().interrupt();
                    return null;
                }
                delay = Math.min(delay * 2, 3000);
            }
        }
    }

    // --- shutdown ---------------------------------------------------------------------------

    /**
     * Stops reading and waits up to the shutdown timeout for running tasks, and for the handlers
     * of attempts abandoned at their deadline that still hold an idempotency claim, then deletes
     * the liveness key. Those still running after that keep their consumer alive (renewed in the
     * background) until they end; nothing is put back or given up while it may still run.
     */
    @Override
    public void close() {
        if (!stopping.compareAndSet(false, true)) {
            return;
        }
        Thread l = loop;
        if (l != null) {
            try {
                l.join(cfg.block.toMillis() + 2000);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }
        pool.shutdown();
        long deadline = System.nanoTime() + cfg.shutdownTimeout.toNanos();
        boolean drained;
        try {
            drained = pool.awaitTermination(cfg.shutdownTimeout.toMillis(), TimeUnit.MILLISECONDS)
                    && abandoned.awaitSettled(Duration.ofNanos(deadline - System.nanoTime()));
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            drained = false;
        }
        if (promoter != null) {
            promoter.close();
        }
        if (drained) {
            finishClose();
            return;
        }
        // Liveness belongs to the process while it runs anything it read: keep renewing until
        // the last running task is settled, then let go.
        LOG.warn("{} tasks and {} abandoned attempts still running after the shutdown timeout; "
                + "their consumer stays alive until they end", inFlight.get(), abandoned.size());
        Thread rest = new Thread(() -> {
            try {
                pool.awaitTermination(Long.MAX_VALUE, TimeUnit.MILLISECONDS);
                while (!abandoned.awaitSettled(Duration.ofMinutes(1))) {
                    LOG.info("{} abandoned attempts still running", abandoned.size());
                }
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
            finishClose();
        }, "envelope-close-" + name);
        rest.setDaemon(true);
        rest.start();
    }

    private void finishClose() {
        stats.close(leaseLink);
        lease.shutdownNow();
        handlerThreads.shutdownNow();
        announce(true);
        liveness.close();
        try {
            liveness.delete();
        } catch (RuntimeException e) {
            LOG.warn("deleting the liveness key failed: {}", e.toString());
        }
        results.close();
        waiters.shutdownNow();
        blockLinks.values().forEach(Link::close);
        leaseLink.close();
        txLink.close();
        link.close();
        if (ownsClient) {
            Redis.shutdown(client);
        }
        LOG.info("worker stopped: queue={} consumer={}", name, consumer);
    }

    private static String hostName() {
        try {
            return InetAddress.getLocalHost().getHostName().replace(' ', '_');
        } catch (Exception e) {
            return "localhost";
        }
    }

    private static ThreadFactory named(String name) {
        AtomicInteger n = new AtomicInteger();
        return r -> {
            Thread t = new Thread(r, name + "-" + n.incrementAndGet());
            t.setDaemon(true);
            return t;
        };
    }

    private record Handler(ResultHandler handler, Set<Long> versions) {}

    /** Options of a {@link Worker}. */
    public static final class Builder {
        private String redisUri = "redis://127.0.0.1:6379";
        private AbstractRedisClient client;
        private Link.Durability durability = Link.Durability.NONE;
        private Duration outageTolerance = Duration.ofSeconds(30);
        private String prefix = Keys.DEFAULT_PREFIX;
        private List<String> queues = List.of("celery");
        private String group = Keys.DEFAULT_GROUP;
        private String consumer;
        private int concurrency = 4;
        private long leaseMs = 30_000;
        private Duration block = Duration.ofSeconds(1);
        private Duration shutdownTimeout = Duration.ofSeconds(30);
        private Duration deferDelay = Duration.ofSeconds(3);
        private Duration idemDoneTtl = Duration.ofHours(24);
        private int retryConcurrency = 5;
        private int maxRedeliveries = 10;
        private RetryPolicy retryPolicy = RetryPolicy.DEFAULT;
        private Limits limits = Limits.DEFAULT;
        private int gzipMin = EntryCodec.GZIP_MIN_BYTES;
        private boolean runPromoter = true;
        private boolean takeOver = true;
        private boolean closeOnShutdown;
        private Duration forgetAfter = Duration.ofHours(1);
        private Duration forgetEvery = Duration.ofMinutes(1);
        private Predicate<Throwable> isTransient;
        private java.util.function.Consumer<Envelope> onDuplicate;
        private RedisClient resultBackend;
        private Duration taskRecordRetention = TaskRecords.DEFAULT_RETENTION;
        private Duration schemaCache = PayloadSchemas.DEFAULT_CACHE;
        private OpenTelemetry openTelemetry;
        private final Map<String, Handler> handlers = new HashMap<>();

        private Builder() {}

        /**
         * A Redis URL: {@code redis://127.0.0.1:6379/0}, a Sentinel ({@code redis-sentinel://...#master})
         * or a Cluster ({@code redis-cluster://...}); see {@link RedisUrl}. Checked at once.
         */
        public Builder redisUri(String v) { RedisUrl.parse(v); redisUri = v; return this; }
        /** Share a Lettuce client, direct or Sentinel (the worker then does not shut it down). */
        public Builder client(RedisClient v) { client = v; return this; }
        /** Share a Lettuce Redis Cluster client (the worker then does not shut it down). */
        public Builder client(RedisClusterClient v) { client = v; return this; }
        /**
         * After each ack, retry and dead letter, {@code WAIT} for {@code replicas} replicas of the
         * primary that took it, at most {@code timeout}; fewer is logged and the step stands (0,
         * the default: no WAIT).
         */
        public Builder waitReplicas(int replicas, Duration timeout) {
            durability = new Link.Durability(replicas, timeout);
            return this;
        }
        /** How long a step that settles an entry is retried while Redis is away or failing over (30 s). */
        public Builder outageTolerance(Duration v) { outageTolerance = Objects.requireNonNull(v); return this; }
        public Builder prefix(String v) { prefix = Objects.requireNonNull(v); return this; }
        /** The one queue to consume ({@code celery} unless set). */
        public Builder queue(String v) { return queues(v); }
        /**
         * The queues to consume, served in this order: an earlier queue gets the credit first (the
         * order of Celery's {@code -Q}). On a Cluster they may live on different shards.
         */
        public Builder queues(String... v) {
            if (v.length == 0) {
                throw new IllegalArgumentException("queues must name at least one queue");
            }
            java.util.LinkedHashSet<String> names = new java.util.LinkedHashSet<>();
            for (String q : v) {
                if (!names.add(Keys.checkQueueName(q))) {
                    throw new IllegalArgumentException("queue " + q + " is named twice");
                }
            }
            queues = List.copyOf(names);
            return this;
        }
        public Builder group(String v) { group = Objects.requireNonNull(v); return this; }
        /** The consumer name (no spaces); {@code <host>-<pid>-<random>} unless set. */
        public Builder consumer(String v) {
            if (v != null && (v.isEmpty() || v.contains(" "))) {
                throw new IllegalArgumentException("consumer name must be non-empty and without spaces");
            }
            if (Keys.PARKED_CONSUMER.equals(v)) {
                throw new IllegalArgumentException("consumer name \"parked\" is reserved for parked entries");
            }
            consumer = v;
            return this;
        }
        /** Tasks run at once (4 by default); also the most entries held. */
        public Builder concurrency(int v) {
            if (v < 1) {
                throw new IllegalArgumentException("concurrency must be >= 1");
            }
            concurrency = v;
            return this;
        }
        public Builder lease(Duration v) { leaseMs = Math.max(300, v.toMillis()); return this; }
        /** Longest wait of one blocking read (1 s by default). */
        public Builder block(Duration v) { block = Objects.requireNonNull(v); return this; }
        public Builder shutdownTimeout(Duration v) { shutdownTimeout = Objects.requireNonNull(v); return this; }
        /** How far a busy idempotency key defers an entry (3 s by default). */
        public Builder deferDelay(Duration v) { deferDelay = Objects.requireNonNull(v); return this; }
        public Builder idempotencyDoneTtl(Duration v) { idemDoneTtl = Objects.requireNonNull(v); return this; }
        public Builder retryConcurrency(int v) { retryConcurrency = v; return this; }
        public Builder maxRedeliveries(int v) { maxRedeliveries = v; return this; }
        public Builder retryPolicy(RetryPolicy v) { retryPolicy = Objects.requireNonNull(v); return this; }
        public Builder limits(Limits v) { limits = Objects.requireNonNull(v); return this; }
        public Builder gzipMinBytes(int v) { gzipMin = v; return this; }
        /** Whether the worker runs a promoter for delayed tasks (true by default). */
        public Builder runPromoter(boolean v) { runPromoter = v; return this; }
        /** Whether the worker takes over entries of dead consumers (true by default). */
        public Builder takeOverDeadConsumers(boolean v) { takeOver = v; return this; }
        /**
         * Closes the worker from a JVM shutdown hook (SIGTERM, SIGINT): it stops reading, lets
         * running tasks finish within the shutdown timeout and deletes its liveness key.
         */
        public Builder closeOnShutdown(boolean v) { closeOnShutdown = v; return this; }
        /** How long a dead consumer holding nothing stays in the group (1 h), and how often to look (1 min). */
        public Builder forgetDeadConsumersAfter(Duration after, Duration every) {
            forgetAfter = Objects.requireNonNull(after);
            forgetEvery = Objects.requireNonNull(every);
            return this;
        }
        /** Marks more errors as transient (connection errors always are). */
        public Builder transientErrors(Predicate<Throwable> v) { isTransient = v; return this; }
        /** Called with each Envelope acknowledged as a duplicate of a done idempotency key. */
        public Builder onDuplicate(java.util.function.Consumer<Envelope> v) { onDuplicate = v; return this; }

        /**
         * The Redis of Celery's result backend (docs/protocol.md section 12): tasks whose Envelope
         * carries {@code ext.celery.result} get their SUCCESS, FAILURE or REVOKED result written
         * there. The worker opens its own connection and does not shut the client down.
         */
        public Builder resultBackend(RedisClient v) { resultBackend = v; return this; }

        /**
         * How long the record of a finished task is kept ({@code task_record_retention}, 1 h by
         * default); zero writes no task records (docs/protocol.md section 14).
         */
        public Builder taskRecordRetention(Duration v) { taskRecordRetention = Objects.requireNonNull(v); return this; }

        /** How long payload schemas read from Redis are used ({@code schema_cache_s}, 30 s by default). */
        public Builder schemaCache(Duration v) { schemaCache = Objects.requireNonNull(v); return this; }

        /**
         * The OpenTelemetry whose tracer makes the {@code process <queue>} spans; unless set,
         * {@link io.opentelemetry.api.GlobalOpenTelemetry} (a no-op until an SDK is installed).
         */
        public Builder openTelemetry(OpenTelemetry v) { openTelemetry = Objects.requireNonNull(v); return this; }

        /** Registers the handler of {@code taskType}, accepting payload_version 1. */
        public Builder handler(String taskType, TaskHandler handler) {
            return handler(taskType, Set.of(1L), handler);
        }

        /** Registers the handler of {@code taskType}, accepting the given payload versions. */
        public Builder handler(String taskType, Set<Long> payloadVersions, TaskHandler handler) {
            Objects.requireNonNull(handler, "handler");
            return resultHandler(taskType, payloadVersions, task -> {
                handler.handle(task);
                return null;
            });
        }

        /** Registers a handler of {@code taskType} whose return value is the task's result; payload_version 1. */
        public Builder resultHandler(String taskType, ResultHandler handler) {
            return resultHandler(taskType, Set.of(1L), handler);
        }

        /** Registers a handler of {@code taskType} whose return value is the task's result. */
        public Builder resultHandler(String taskType, Set<Long> payloadVersions, ResultHandler handler) {
            Objects.requireNonNull(handler, "handler");
            if (payloadVersions == null || payloadVersions.isEmpty()) {
                throw new IllegalArgumentException("payloadVersions must not be empty");
            }
            handlers.put(Objects.requireNonNull(taskType, "taskType"), new Handler(handler, Set.copyOf(payloadVersions)));
            return this;
        }

        public Worker build() {
            return new Worker(this);
        }
    }
}

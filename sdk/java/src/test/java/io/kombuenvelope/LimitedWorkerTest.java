package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.ScriptOutputType;

import java.time.Duration;
import java.util.ArrayList;
import java.util.Comparator;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.stream.Collectors;

import org.junit.jupiter.api.Test;

/** Workers on queues with limits per task type (docs/protocol.md section 19), against a real redis-server. */
class LimitedWorkerTest extends RedisFixture {
    static final String QUEUE = "limited";
    static final String SLOW = "limits.slow";
    static final String FAST = "limits.fast";
    static final Duration LEASE = Duration.ofMillis(1500);

    /** One attempt as its handler saw it, times in ms since the epoch. */
    record Run(String taskId, String taskType, int redeliveries, long start, long end) {}

    /** The attempts run, and how many run at once (now and at most). */
    static final class Runs {
        final List<Run> done = new CopyOnWriteArrayList<>();
        final AtomicInteger running = new AtomicInteger();
        final AtomicInteger most = new AtomicInteger();

        /** A handler that sleeps {@code sleepMs} and records the attempt. */
        TaskHandler sleeping(long sleepMs) {
            return task -> {
                long start = System.currentTimeMillis();
                most.accumulateAndGet(running.incrementAndGet(), Math::max);
                try {
                    Thread.sleep(sleepMs);
                } finally {
                    running.decrementAndGet();
                    done.add(new Run(task.taskId(), task.taskType(), task.redeliveries(), start,
                            System.currentTimeMillis()));
                }
            };
        }

        boolean ran(String taskId) {
            return done.stream().anyMatch(r -> r.taskId().equals(taskId));
        }

        List<Run> of(String taskType) {
            return done.stream().filter(r -> r.taskType().equals(taskType)).sorted(Comparator.comparing(Run::start))
                    .toList();
        }
    }

    Worker.Builder worker(Runs runs, long slowMs) {
        return Worker.builder().client(client).prefix(prefix).queue(QUEUE).concurrency(4).lease(LEASE)
                .block(Duration.ofMillis(200)).shutdownTimeout(Duration.ofSeconds(5)).runPromoter(false)
                .handler(SLOW, runs.sleeping(slowMs)).handler(FAST, runs.sleeping(10));
    }

    Producer producer() {
        return Producer.builder().client(client).prefix(prefix).queue(QUEUE).build();
    }

    TaskLimits limits() {
        return TaskLimits.builder().client(client).prefix(prefix).build();
    }

    List<String> publish(Producer p, String taskType, int n) {
        return java.util.stream.IntStream.range(0, n)
                .mapToObj(i -> p.publish(Envelope.builder(taskType).build()).taskId()).toList();
    }

    /** The most intervals of {@code runs} that overlap at one instant. */
    static int mostAtOnce(List<Run> runs) {
        int most = 0;
        for (Run r : runs) {
            long at = r.start();
            most = Math.max(most, (int) runs.stream().filter(o -> o.start() <= at && at < o.end()).count());
        }
        return most;
    }

    static void await(String what, java.util.function.BooleanSupplier cond) throws InterruptedException {
        RoundTripTest.await(what, cond);
    }

    @Test
    void aConcurrencyCapHoldsAcrossWorkersWhileOtherTypesFlowPast() throws Exception {
        Runs runs = new Runs();
        try (TaskLimits l = limits(); Producer p = producer()) {
            l.set(QUEUE, SLOW, TaskLimit.builder().concurrency(2).build());
            List<String> ids = new java.util.ArrayList<>(publish(p, SLOW, 12));
            ids.addAll(publish(p, FAST, 12));
            try (Worker a = worker(runs, 150).build().start(); Worker b = worker(runs, 150).build().start()) {
                await("24 attempts", () -> runs.done.size() >= 24);
                Thread.sleep(200);
            }
            assertEquals(Set.copyOf(ids), runs.done.stream().map(Run::taskId).collect(Collectors.toSet()));
            assertEquals(24, runs.done.size(), "a task ran twice");
            assertEquals(2, mostAtOnce(runs.of(SLOW)), "the cap of 2 was exceeded or never reached");
            long fastDone = runs.of(FAST).stream().mapToLong(Run::end).max().orElseThrow();
            long slowDone = runs.of(SLOW).stream().mapToLong(Run::end).max().orElseThrow();
            assertTrue(fastDone < slowDone, "the unlimited tasks waited behind the slow backlog");
            assertEquals(0, redis.xpending(keys.stream(QUEUE, "normal"), Keys.DEFAULT_GROUP).getCount());
            assertEquals(0, redis.zcard(keys.running(QUEUE, SLOW)), "a slot outlived its attempt");
        }
    }

    @Test
    void aRateSpacesTheStarts() throws Exception {
        Runs runs = new Runs();
        try (TaskLimits l = limits(); Producer p = producer()) {
            l.set(QUEUE, FAST, TaskLimit.builder().rate(20).burst(1).build());
            publish(p, FAST, 40);
            try (Worker w = worker(runs, 0).build().start()) {
                await("40 attempts", () -> runs.done.size() >= 40);
            }
            List<Long> starts = runs.of(FAST).stream().map(Run::start).toList();
            long span = starts.get(39) - starts.get(0);
            assertTrue(span >= 1600 && span <= 2600, "40 starts at 20/s took " + span + " ms");
            long widest = 0;
            for (int i = 1; i < starts.size(); i++) {
                widest = Math.max(widest, starts.get(i) - starts.get(i - 1));
            }
            assertTrue(widest <= 150, "the delivery resumed " + widest + " ms after the last start (token each 50 ms)");
        }
    }

    @Test
    void aSlotOfAConsumerThatDisappearedComesBackAfterTheLease() throws Exception {
        Runs runs = new Runs();
        try (TaskLimits l = limits(); Producer p = producer()) {
            l.set(QUEUE, SLOW, TaskLimit.builder().concurrency(1).build());
            String held = publish(p, SLOW, 1).get(0);
            ensureGroups();
            long before = System.currentTimeMillis();
            ReadReply ghost = ReadReply.parse(Scripts.run(redis, "read", ScriptOutputType.MULTI,
                    keys.taskStreams(QUEUE), Keys.DEFAULT_GROUP, "ghost", 1, LEASE.toMillis(), 1));
            long after = System.currentTimeMillis();
            assertEquals(1, ghost.entries().size(), "the consumer that disappears read nothing");
            String parked = publish(p, SLOW, 1).get(0);
            try (Worker w = worker(runs, 10).takeOverDeadConsumers(false).build().start()) {
                await("the parked task", () -> runs.done.size() >= 1);
            }
            Run run = runs.done.get(0);
            assertEquals(parked, run.taskId());
            assertTrue(run.start() >= before + LEASE.toMillis(), "the parked task started "
                    + (run.start() - before) + " ms after the slot was taken, before its deadline");
            assertTrue(run.start() <= after + LEASE.toMillis() + 700, "the parked task started "
                    + (run.start() - after - LEASE.toMillis()) + " ms after the slot's deadline");
            assertTrue(runs.done.stream().noneMatch(r -> r.taskId().equals(held)));
        }
    }

    @Test
    void aTaskLongerThanTheLeaseKeepsItsSlot() throws Exception {
        Runs runs = new Runs();
        try (TaskLimits l = limits(); Producer p = producer()) {
            l.set(QUEUE, SLOW, TaskLimit.builder().concurrency(1).build());
            publish(p, SLOW, 2);
            try (Worker w = worker(runs, 1000).lease(Duration.ofMillis(600)).build().start()) {
                await("2 attempts", () -> runs.done.size() >= 2);
            }
            List<Run> slow = runs.of(SLOW);
            assertTrue(slow.get(1).start() >= slow.get(0).end(), "the slot of a running task expired: " + slow);
        }
    }

    @Test
    void aLimitChangedAtRunTimeTakesEffectWithoutARestart() throws Exception {
        Runs runs = new Runs();
        try (TaskLimits l = limits(); Producer p = producer()) {
            l.set(QUEUE, SLOW, TaskLimit.builder().concurrency(1).build());
            publish(p, SLOW, 8);
            try (Worker w = worker(runs, 300).build().start()) {
                await("the first attempt", () -> runs.running.get() == 1);
                Thread.sleep(700);
                assertEquals(1, runs.most.get(), "the cap of 1 was exceeded");
                l.set(QUEUE, SLOW, TaskLimit.builder().concurrency(3).build());
                await("three attempts at once", () -> runs.most.get() == 3);
                await("8 attempts", () -> runs.done.size() >= 8);
            }
            assertEquals(3, runs.most.get(), "the raised cap of 3 was exceeded");
        }
    }

    @Test
    void parkedEntriesAreNeverTakenOver() throws Exception {
        Runs runs = new Runs();
        try (TaskLimits l = limits(); Producer p = producer()) {
            l.set(QUEUE, FAST, TaskLimit.builder().rate(0.4).build());
            List<String> ids = publish(p, FAST, 2);
            try (Worker w = worker(runs, 0).build().start()) {
                // The second waits 2.5 s for its token, parked: past a lease and two renewals.
                await("both attempts", () -> runs.done.size() >= 2);
            }
            Map<String, Run> byId = runs.done.stream().collect(Collectors.toMap(Run::taskId, r -> r));
            assertEquals(Set.copyOf(ids), byId.keySet());
            assertEquals(0, byId.get(ids.get(1)).redeliveries(), "the parked entry was taken over");
            // Handed out 2.5 s apart by Redis' clock; the handlers' start times lag their hand-out
            // by the worker's own delay, which a loaded machine stretches for the first one.
            assertTrue(byId.get(ids.get(1)).start() - byId.get(ids.get(0)).start() >= 2000, "the rate was not kept");
        }
    }

    /**
     * Failures reach read.lua through the statistics the workers write with each renewal (every 500 ms
     * here), and a closed breaker samples them at most once a second: it opens about a second after
     * the first failing task was read, past the four failures it needs.
     */
    @Test
    void aBreakerOpensOnFailuresHoldsItsTypeBackForTheCooldownAndAProbeClosesIt() throws Exception {
        String flaky = "limits.flaky";
        String breaker = keys.base(QUEUE) + ":breaker:" + flaky;
        Runs runs = new Runs();
        AtomicBoolean failing = new AtomicBoolean(true);
        TaskHandler sleeping = runs.sleeping(50);
        TaskHandler handler = task -> {
            boolean fails = failing.get();
            sleeping.handle(task);
            if (fails) {
                throw new IllegalStateException("flaky");
            }
        };
        try (TaskLimits l = limits(); Producer p = producer();
             Worker a = worker(runs, 0).handler(flaky, handler).build().start();
             Worker b = worker(runs, 0).handler(flaky, handler).build().start()) {
            l.set(QUEUE, flaky, TaskLimit.builder().breaker(TaskLimit.Breaker.builder().failureRatio(0.5)
                    .minAttempts(4).windowSeconds(30).cooldownSeconds(1.5).probes(1).build()).build());
            // One failing task at a time, so that none is in flight when the breaker opens.
            List<String> failed = new ArrayList<>();
            while (!"open".equals(RoundTripTest.s(redis.hget(breaker, "state")))) {
                assertTrue(failed.size() < 200, "the breaker never opened");
                String id = p.publish(Envelope.builder(flaky).maxRetries(0L).build()).taskId();
                await("the failing task or an open breaker", () -> runs.ran(id)
                        || "open".equals(RoundTripTest.s(redis.hget(breaker, "state"))));
                failed.add(id);
            }
            // Redis' time in ms, with a fraction.
            long since = (long) Double.parseDouble(RoundTripTest.s(redis.hget(breaker, "since")));
            List<String> held = new ArrayList<>(publish(p, flaky, 5));
            failing.set(false);
            assertTrue(System.currentTimeMillis() < since + 1500, "the test was too slow for the cool-down");
            held.addAll(failed.stream().filter(id -> !runs.ran(id)).toList());
            await("the held tasks", () -> held.stream().allMatch(runs::ran));

            List<Run> flakyRuns = runs.of(flaky);
            assertEquals(failed.size() + 5, flakyRuns.size(), "a task ran twice or not at all");
            List<Run> after = flakyRuns.stream().filter(r -> r.start() >= since).toList();
            assertEquals(Set.copyOf(held), after.stream().map(Run::taskId).collect(Collectors.toSet()),
                    "tasks started while the breaker was open, or held tasks before it opened");
            assertTrue(after.get(0).start() >= since + 1500,
                    "a task started " + (after.get(0).start() - since) + " ms into the cool-down of 1500 ms");
            assertTrue(after.get(1).start() >= after.get(0).end(), "more than one probe started: " + after);
            assertEquals("closed", RoundTripTest.s(redis.hget(breaker, "state")), "the probe did not close it");
            List<Run> failures = flakyRuns.stream().filter(r -> r.start() < since).toList();
            assertTrue(failures.size() >= 4, "the breaker opened after " + failures.size() + " failures");
            assertTrue(since - failures.get(3).end() <= 2500, "the breaker opened "
                    + (since - failures.get(3).end()) + " ms after the fourth failure");
            assertEquals(failures.size(), redis.xlen(keys.dead(QUEUE)), "the held tasks did not succeed");
        }
    }

    @Test
    void theParkedConsumerNameIsReserved() {
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                () -> Worker.builder().consumer(Keys.PARKED_CONSUMER));
        assertTrue(e.getMessage().contains("reserved"), e.getMessage());
    }

    private void ensureGroups() {
        for (String stream : keys.taskStreams(QUEUE)) {
            try {
                redis.xgroupCreate(io.lettuce.core.XReadArgs.StreamOffset.from(stream, "0"), Keys.DEFAULT_GROUP,
                        io.lettuce.core.XGroupCreateArgs.Builder.mkstream(true));
            } catch (io.lettuce.core.RedisBusyException ignored) {
                // exists
            }
        }
    }
}

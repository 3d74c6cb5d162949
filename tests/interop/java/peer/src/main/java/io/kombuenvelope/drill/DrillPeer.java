package io.kombuenvelope.drill;

import io.kombuenvelope.RetryPolicy;
import io.kombuenvelope.Worker;

import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.CountDownLatch;

/**
 * A Java worker of the fault drill ({@code bench/drill}, {@code python -m bench drill --languages
 * ...}). It works the queues of {@code --work} with {@link DrillHandler} for {@code drill.effect},
 * the task the drill's Celery producer publishes, and records in the ledger Redis named by
 * {@code DRILL_LEDGER_URL} (run {@code DRILL_RUN}) what {@code bench/drill/app.py} records for
 * Celery; {@code ready} once its worker runs. SIGTERM stops the worker.
 *
 * <pre>java -cp ... io.kombuenvelope.drill.DrillPeer --redis URL --prefix P --work Q1,Q2,... --hostname H
 *     [--lease-ms N] [--concurrency N] [--wait-replicas N]</pre>
 */
public final class DrillPeer {
    private DrillPeer() {
    }

    public static void main(String[] args) throws Exception {
        Map<String, String> opts = new HashMap<>(Map.of("lease-ms", "3000", "concurrency", "2",
                "wait-replicas", "0"));
        for (int i = 0; i + 1 < args.length; i += 2) {
            if (!args[i].startsWith("--")) {
                throw new IllegalArgumentException("bad argument " + args[i]);
            }
            opts.put(args[i].substring(2), args[i + 1]);
        }
        for (String name : new String[] {"redis", "prefix", "work", "hostname"}) {
            if (!opts.containsKey(name)) {
                System.err.println("DrillPeer: --" + name + " is required");
                System.exit(64);
            }
        }
        String ledgerUrl = System.getenv("DRILL_LEDGER_URL");
        String run = System.getenv("DRILL_RUN");
        if (ledgerUrl == null || run == null) {
            System.err.println("DrillPeer: DRILL_LEDGER_URL and DRILL_RUN must be set");
            System.exit(64);
        }
        CountDownLatch stopped = new CountDownLatch(1);
        try (Ledger ledger = new Ledger(ledgerUrl, run, opts.get("hostname"))) {
            Worker worker = Worker.builder().redisUri(opts.get("redis")).prefix(opts.get("prefix"))
                    .queues(opts.get("work").split(","))
                    .concurrency(Integer.parseInt(opts.get("concurrency")))
                    .lease(Duration.ofMillis(Long.parseLong(opts.get("lease-ms"))))
                    .block(Duration.ofMillis(500)).deferDelay(Duration.ofSeconds(1))
                    .shutdownTimeout(Duration.ofSeconds(5))
                    .retryPolicy(new RetryPolicy(2, Duration.ofSeconds(1), Duration.ofSeconds(4)))
                    .waitReplicas(Integer.parseInt(opts.get("wait-replicas")), Duration.ofSeconds(1))
                    .runPromoter(true)
                    .handler(DrillHandler.TASK_TYPE, new DrillHandler(ledger))
                    .build().start();
            Runtime.getRuntime().addShutdownHook(new Thread(() -> {
                worker.close();
                stopped.countDown();
            }));
            ledger.add("ready", Map.of());
            stopped.await();
        }
    }
}

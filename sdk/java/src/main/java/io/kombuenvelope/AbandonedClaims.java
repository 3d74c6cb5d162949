package io.kombuenvelope;

import java.time.Duration;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import java.util.function.Consumer;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Idempotency claims of attempts a worker abandoned at their deadline while their handlers still
 * run (docs/protocol.md section 8, "A timed-out attempt that cannot be stopped"). Each claim is
 * renewed until its handler really returns and then settled ({@code done} or {@code release});
 * the worker keeps the key's mark meanwhile, so its own retries of a kept key are deferred.
 */
final class AbandonedClaims {
    private static final Logger LOG = LoggerFactory.getLogger(AbandonedClaims.class);

    private final ScheduledExecutorService timer;
    private final Map<String, CompletableFuture<Void>> kept = new ConcurrentHashMap<>();

    /** Renews claims from {@code timer}. */
    AbandonedClaims(ScheduledExecutorService timer) {
        this.timer = timer;
    }

    /**
     * Keeps the claim on {@code key}: runs {@code renew} every {@code every} until {@code returned}
     * completes, then {@code settle} with whether the handler returned normally.
     */
    void keep(String key, Duration every, Runnable renew, CompletableFuture<?> returned, Consumer<Boolean> settle) {
        CompletableFuture<Void> settled = new CompletableFuture<>();
        kept.put(key, settled);
        long ms = Math.max(1, every.toMillis());
        ScheduledFuture<?> renewal = timer.scheduleWithFixedDelay(() -> {
            try {
                renew.run();
            } catch (RuntimeException ex) {
                LOG.warn("renewing the idempotency claim of an abandoned attempt failed: {}", ex.toString());
            }
        }, ms, ms, TimeUnit.MILLISECONDS);
        returned.whenComplete((value, error) -> {
            renewal.cancel(false);
            try {
                settle.accept(error == null);
            } finally {
                kept.remove(key, settled);
                settled.complete(null);
            }
        });
    }

    /** How many claims are kept now. */
    int size() {
        return kept.size();
    }

    /** Waits up to {@code timeout} until every claim kept now is settled; true when they are. */
    boolean awaitSettled(Duration timeout) throws InterruptedException {
        try {
            CompletableFuture.allOf(kept.values().toArray(CompletableFuture[]::new))
                    .get(Math.max(0, timeout.toMillis()), TimeUnit.MILLISECONDS);
            return true;
        } catch (TimeoutException ex) {
            return false;
        } catch (ExecutionException ex) {
            throw new IllegalStateException("a settled claim never fails", ex);
        }
    }
}

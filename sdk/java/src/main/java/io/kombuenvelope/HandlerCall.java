package io.kombuenvelope;

import java.util.concurrent.Callable;
import java.util.concurrent.CancellationException;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.Executor;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;

/**
 * One call of a handler on a thread of its own, which the caller may wait for within a deadline
 * and then stop by interruption. {@link #returned()} completes when the handler really returns,
 * also after it was stopped: a handler that ignores interruption goes on running
 * (docs/protocol.md section 8, "A timed-out attempt that cannot be stopped").
 */
final class HandlerCall {
    private final CompletableFuture<Object> returned = new CompletableFuture<>();
    private Thread runner;
    private boolean stopped;

    private HandlerCall() {}

    /** Starts {@code handler} on {@code threads}. */
    static HandlerCall start(Executor threads, Callable<Object> handler) {
        HandlerCall call = new HandlerCall();
        threads.execute(() -> call.run(handler));
        return call;
    }

    private void run(Callable<Object> handler) {
        synchronized (this) {
            if (stopped) {
                returned.completeExceptionally(new CancellationException("stopped before it started"));
                return;
            }
            runner = Thread.currentThread();
        }
        Object value = null;
        Throwable error = null;
        try {
            value = handler.call();
        } catch (Throwable t) {
            error = t;
        }
        synchronized (this) {
            runner = null;
        }
        Thread.interrupted(); // a stop that came as the handler returned stays with this call
        if (error == null) {
            returned.complete(value);
        } else {
            returned.completeExceptionally(error);
        }
    }

    /**
     * The handler's value, waited for up to {@code timeoutMs} (null: no limit).
     *
     * @throws ExecutionException with the handler's error as its cause
     * @throws TimeoutException when the handler is still running at the deadline
     */
    Object await(Long timeoutMs) throws ExecutionException, TimeoutException, InterruptedException {
        return timeoutMs == null ? returned.get() : returned.get(timeoutMs, TimeUnit.MILLISECONDS);
    }

    /** Interrupts the handler, or keeps it from starting. */
    synchronized void stop() {
        stopped = true;
        if (runner != null) {
            runner.interrupt();
        }
    }

    /** Completes with the handler's value, or exceptionally with its error, when it returns. */
    CompletableFuture<Object> returned() {
        return returned;
    }
}

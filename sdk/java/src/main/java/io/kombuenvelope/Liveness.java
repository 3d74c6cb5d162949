package io.kombuenvelope;

import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.SetArgs;
import io.lettuce.core.event.connection.ReconnectAttemptEvent;
import io.lettuce.core.event.connection.ReconnectFailedEvent;

import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
import java.util.function.Supplier;

import reactor.core.Disposable;

/**
 * A worker's liveness key, and whether its looks at Redis can be trusted for taking over the work
 * of dead consumers (docs/protocol.md sections 5 and 9). A renewal counts only when it was
 * answered at once; one that waited for Redis (sent while the connection was down, retried or
 * re-sent by Lettuce while it reconnected, or answered later than one renewal interval,
 * {@code lease_ms / 3}, after it was sent) starts the count again from zero, and so does any
 * command of a takeover that waited that way. Lettuce buffers commands while it reconnects, so a
 * renewal can wait through an outage and still succeed: its reconnection events and the time
 * each command took tell such a renewal apart.
 */
final class Liveness implements AutoCloseable {
    /** A command waited for Redis: what it answered cannot be trusted for a takeover. */
    static final class Waited extends RuntimeException {
        Waited(String what) {
            super(what);
        }
    }

    private final Link link;
    private final Keys keys;
    private final String key;
    private final byte[] value;
    private final long leaseMs;
    private final long intervalNs;
    /** Reconnections of any connection of the client seen so far. */
    private final AtomicLong reconnects = new AtomicLong();
    private final AtomicInteger inARow = new AtomicInteger();
    private final Disposable events;

    /** The liveness key of {@code consumer} holding {@code value}, renewed on {@code link} of {@code client}. */
    Liveness(AbstractRedisClient client, Link link, Keys keys, String consumer, byte[] value, long leaseMs) {
        this.link = link;
        this.keys = keys;
        this.key = keys.consumer(consumer);
        this.value = value;
        this.leaseMs = leaseMs;
        this.intervalNs = TimeUnit.MILLISECONDS.toNanos(intervalMs());
        this.events = client.getResources().eventBus().get()
                .filter(e -> e instanceof ReconnectAttemptEvent || e instanceof ReconnectFailedEvent)
                .subscribe(e -> reconnects.incrementAndGet());
    }

    /** One renewal interval, {@code lease_ms / 3}, in ms. */
    long intervalMs() {
        return Math.max(1, leaseMs / 3);
    }

    /**
     * Sets the key for one lease; answers whether the renewal counted. One that waited resets the
     * count and answers false; one that failed resets it and throws.
     */
    boolean renew() {
        try {
            prompt("renewing the liveness key", () -> link.sync().set(key, value, SetArgs.Builder.px(leaseMs)));
        } catch (Waited w) {
            return false;
        } catch (RuntimeException e) {
            inARow.set(0);
            throw e;
        }
        inARow.incrementAndGet();
        return true;
    }

    /** Whether the last two renewals, in a row, were answered at once: takeovers are allowed. */
    boolean mayTakeOver() {
        return inARow.get() >= 2;
    }

    /**
     * Runs a command of a takeover and answers its reply; throws {@link Waited}, resetting the
     * count, when it waited for Redis. An outage error resets the count too.
     */
    <T> T prompt(String what, Supplier<T> command) {
        Look look = look(what);
        T reply = look.timed(command);
        look.check();
        return reply;
    }

    /** A look at Redis about to be sent, for a command whose reply must be used before it is checked. */
    Look look(String what) {
        return new Look(what);
    }

    /** Whether the liveness key of {@code owner} exists, looked at once ({@link Waited} otherwise). */
    boolean alive(String owner) {
        return prompt("looking at the liveness key of " + owner, () -> link.sync().exists(keys.consumer(owner))) > 0;
    }

    /**
     * Whether the holder {@code owner} of an idempotency claim is dead (section 9): its key is gone
     * at a first look and still gone one renewal interval later (a live holder whose key expired
     * during an outage renews it within that interval), neither look waited for Redis, and this
     * worker's own renewals allow a takeover. Blocks for one interval when the first look finds
     * no key.
     */
    boolean holderGone(String owner) throws InterruptedException {
        if (alive(owner)) {
            return false;
        }
        Thread.sleep(intervalMs());
        return !alive(owner) && mayTakeOver();
    }

    /** Deletes the key (the worker stops). */
    void delete() {
        link.sync().del(key);
    }

    /** Stops watching the client's reconnections. */
    @Override
    public void close() {
        events.dispose();
    }

    /** One command, sent now: did it wait for Redis? */
    final class Look {
        private final String what;
        private final long sentAt = System.nanoTime();
        private final long reconnectsBefore = reconnects.get();
        private final boolean open = link.isOpen();
        private long answeredAt;

        private Look(String what) {
            this.what = what;
        }

        /** Runs the command, noting when it was answered; an outage error resets the count. */
        <T> T timed(Supplier<T> command) {
            try {
                return command.get();
            } catch (RuntimeException e) {
                if (Redis.isOutage(e)) {
                    inARow.set(0);
                }
                throw e;
            } finally {
                answeredAt = System.nanoTime();
            }
        }

        /** Throws {@link Waited}, resetting the count, when the command waited for Redis. */
        void check() {
            long took = (answeredAt != 0 ? answeredAt : System.nanoTime()) - sentAt;
            String why = !open ? "it was sent while the connection was down"
                    : reconnects.get() != reconnectsBefore ? "the client reconnected meanwhile"
                    : took > intervalNs ? "it was answered after " + TimeUnit.NANOSECONDS.toMillis(took) + " ms"
                    : null;
            if (why != null) {
                inARow.set(0);
                throw new Waited(what + " waited for Redis (" + why + ")");
            }
        }
    }
}

package io.kombuenvelope;

import io.lettuce.core.ClientOptions;
import io.lettuce.core.RedisBusyException;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisCommandTimeoutException;
import io.lettuce.core.RedisConnectionException;
import io.lettuce.core.RedisException;
import io.lettuce.core.RedisURI;
import io.lettuce.core.TransactionResult;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.codec.ByteArrayCodec;
import io.lettuce.core.codec.RedisCodec;
import io.lettuce.core.codec.StringCodec;
import io.lettuce.core.protocol.ProtocolVersion;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.function.Consumer;
import java.util.function.Supplier;

/** Lettuce plumbing shared by the producer, worker and promoter. */
final class Redis {
    /** Keys are UTF-8 strings; values stay bytes, so bodies and raw fields pass through exactly. */
    static final RedisCodec<String, byte[]> CODEC = RedisCodec.of(StringCodec.UTF8, ByteArrayCodec.INSTANCE);

    private Redis() {}

    static RedisClient client(String uri) {
        RedisClient client = RedisClient.create(RedisURI.create(uri));
        client.setOptions(ClientOptions.builder().protocolVersion(ProtocolVersion.RESP2)
                .autoReconnect(true).build());
        return client;
    }

    static byte[] b(String s) {
        return s.getBytes(StandardCharsets.UTF_8);
    }

    static String s(Object o) {
        if (o == null) {
            return null;
        }
        if (o instanceof byte[]) {
            return new String((byte[]) o, StandardCharsets.UTF_8);
        }
        return String.valueOf(o);
    }

    /** Whether an error means Redis was unreachable or not ready, so a safe command may be repeated. */
    static boolean isOutage(Throwable e) {
        if (e instanceof RedisConnectionException || e instanceof RedisCommandTimeoutException) {
            return true;
        }
        if (e instanceof RedisBusyException) {
            return false;
        }
        if (e instanceof RedisException) {
            String m = String.valueOf(e.getMessage());
            return m.startsWith("LOADING") || m.startsWith("MASTERDOWN") || m.startsWith("TRYAGAIN")
                    || m.contains("Connection closed") || m.contains("Connection reset") || m.contains("not connected");
        }
        return false;
    }

    /** Repeats {@code call} while Redis is unreachable, for at most {@code tolerance}. */
    static <T> T retrying(Duration tolerance, Supplier<T> call) {
        long deadline = System.nanoTime() + tolerance.toNanos();
        long delay = 50;
        while (true) {
            try {
                return call.get();
            } catch (RuntimeException e) {
                if (!isOutage(e) || System.nanoTime() + delay * 1_000_000 > deadline) {
                    throw e;
                }
                try {
                    Thread.sleep(delay);
                } catch (InterruptedException ie) {
                    Thread.currentThread().interrupt();
                    throw e;
                }
                delay = Math.min(delay * 2, 1000);
            }
        }
    }

    /**
     * Runs {@code commands} in one MULTI/EXEC on {@code connection} (used by nothing else meanwhile)
     * and answers the replies; a discarded transaction or a failed command throws, and a
     * transaction left open by a broken connection is discarded, so the next try starts afresh.
     */
    static TransactionResult transaction(StatefulRedisConnection<String, byte[]> connection,
                                         Consumer<RedisCommands<String, byte[]>> commands) {
        synchronized (connection) {
            RedisCommands<String, byte[]> tx = connection.sync();
            try {
                tx.multi();
                commands.accept(tx);
                TransactionResult r = tx.exec();
                if (r.wasDiscarded()) {
                    throw new IllegalStateException("the transaction was discarded");
                }
                for (Object o : r) {
                    if (o instanceof Exception) {
                        throw new IllegalStateException("a command of the transaction failed: " + o);
                    }
                }
                return r;
            } catch (RuntimeException e) {
                if (connection.isMulti()) {
                    try {
                        tx.discard();
                    } catch (RuntimeException ignored) {
                        // the connection broke: it leaves MULTI when it reconnects
                    }
                }
                throw e;
            }
        }
    }
}

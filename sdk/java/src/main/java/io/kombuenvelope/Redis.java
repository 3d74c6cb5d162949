package io.kombuenvelope;

import io.lettuce.core.AbstractRedisClient;
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
import java.util.List;
import java.util.function.Consumer;
import java.util.function.Supplier;

import javax.net.ssl.SSLHandshakeException;

/** Lettuce plumbing shared by the producer, worker and promoter. */
final class Redis {
    /** Keys are UTF-8 strings; values stay bytes, so bodies and raw fields pass through exactly. */
    static final RedisCodec<String, byte[]> CODEC = RedisCodec.of(StringCodec.UTF8, ByteArrayCodec.INSTANCE);

    private Redis() {}

    /** A client of one server ({@code redis://}, {@code rediss://}). */
    static RedisClient client(String uri) {
        return client(RedisURI.create(uri), TlsOptions.DEFAULT);
    }

    /**
     * A client of one server, or of the primary a majority of a Sentinel URI's sentinels name
     * ({@link SentinelClient}), reconnecting by itself, with the CA and client certificate of {@code tls}.
     */
    static RedisClient client(RedisURI uri, TlsOptions tls) {
        RedisClient client = uri.getSentinelMasterId() != null ? new SentinelClient(uri) : RedisClient.create(uri);
        client.setOptions(tls.applyTo(ClientOptions.builder()).protocolVersion(ProtocolVersion.RESP2)
                .autoReconnect(true).build());
        return client;
    }

    /** {@code given}, or a new client for {@code url} when it is null. */
    static AbstractRedisClient clientOr(AbstractRedisClient given, String url) {
        return given != null ? given : RedisUrl.client(url);
    }

    /** {@code open}'s result; when it fails, {@code client} is shut down first if {@code owned} (made by the SDK). */
    static <T> T closingOnFailure(AbstractRedisClient client, boolean owned, Supplier<T> open) {
        try {
            return open.get();
        } catch (RuntimeException | Error e) {
            if (owned) {
                shutdown(client);
            }
            throw e;
        }
    }

    /** Shuts down a client this SDK made. */
    static void shutdown(AbstractRedisClient client) {
        client.shutdown(Duration.ZERO, Duration.ofSeconds(2));
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

    /** Error replies of a node that is not (or not yet) the primary of the keys asked for. */
    private static final List<String> FAILOVER_REPLIES = List.of("LOADING", "MASTERDOWN", "TRYAGAIN", "READONLY",
            "MOVED", "ASK", "CLUSTERDOWN", "UNBLOCKED", "NOREPLICAS");

    /**
     * Whether an error means Redis was unreachable, not ready, or between roles (a failover, a
     * slot that moved), so a safe command may be repeated (docs/protocol.md section 5, failover).
     */
    static boolean isOutage(Throwable e) {
        if (tlsFailure(e) != null || refusedPassword(e)) {
            return false;
        }
        for (Throwable t = e; t != null; t = t.getCause()) {
            if (t instanceof RedisConnectionException || t instanceof RedisCommandTimeoutException
                    || t instanceof java.io.IOException) {
                return true;
            }
            if (t instanceof RedisBusyException) {
                return false;
            }
            if (t instanceof RedisException) {
                String m = String.valueOf(t.getMessage());
                for (String reply : FAILOVER_REPLIES) {
                    if (m.startsWith(reply + " ") || m.equals(reply) || m.contains("ERR " + reply)
                            || m.contains(": " + reply + " ")) {
                        return true;
                    }
                }
                if (m.contains("Connection closed") || m.contains("Connection reset") || m.contains("not connected")
                        || m.contains("Connection refused") || m.contains("EXECABORT")) {
                    return true;
                }
            }
        }
        return false;
    }

    /**
     * Whether a server refused the password ({@code NOAUTH}, {@code WRONGPASS}) among the causes and
     * suppressed errors of {@code e}, also inside a connection error or a Sentinel lookup's error:
     * a setting to fix, which retrying cannot cure (protocol section 5).
     */
    static boolean refusedPassword(Throwable e) {
        if (e == null) {
            return false;
        }
        String m = String.valueOf(e.getMessage());
        if (m.contains("WRONGPASS") || m.contains("NOAUTH")) {
            return true;
        }
        for (Throwable s : e.getSuppressed()) {
            if (refusedPassword(s)) {
                return true;
            }
        }
        return e.getCause() != e && refusedPassword(e.getCause());
    }

    /**
     * The TLS handshake failure (a certificate refused, no common protocol) among the causes and
     * suppressed errors of {@code e}, or null: repeating the connection would only fail again.
     */
    static SSLHandshakeException tlsFailure(Throwable e) {
        if (e == null) {
            return null;
        }
        if (e instanceof SSLHandshakeException h) {
            return h;
        }
        for (Throwable s : e.getSuppressed()) {
            SSLHandshakeException h = tlsFailure(s);
            if (h != null) {
                return h;
            }
        }
        return e.getCause() == e ? null : tlsFailure(e.getCause());
    }

    /**
     * {@code e} as an error that says it is a TLS failure, when it is one: Lettuce's own says only
     * that it could not connect.
     */
    static RuntimeException explainTls(RuntimeException e) {
        SSLHandshakeException h = tlsFailure(e);
        if (h == null) {
            return e;
        }
        return new RedisConnectionException("TLS handshake failed (" + h.getMessage() + "): the server's "
                + "certificate is not trusted or the server refused ours; ssl_ca_certs names the CA to trust, "
                + "ssl_certfile/ssl_keyfile the client certificate, ssl_cert_reqs=none skips the check", e);
    }

    /**
     * Whether an error says the server is not a usable primary now: a failover demoted it
     * ({@code READONLY}, a read {@code UNBLOCKED} by the role change), or it refuses writes for want
     * of replicas ({@code NOREPLICAS}: an old primary that came back after a failover, cut off
     * from its replicas), also when that refusal of a queued command ended a MULTI ({@code EXECABORT}).
     */
    static boolean isRoleChange(Throwable e) {
        for (Throwable t = e; t != null; t = t.getCause()) {
            String m = String.valueOf(t.getMessage());
            if (m.startsWith("READONLY") || m.contains("instance state changed") || m.contains("master -> replica")
                    || m.startsWith("NOREPLICAS") || m.contains("ERR NOREPLICAS") || m.contains(": NOREPLICAS")
                    || m.startsWith("EXECABORT")) {
                return true;
            }
        }
        return false;
    }

    /** Repeats {@code call} while Redis is unreachable, for at most {@code tolerance}. */
    static <T> T retrying(Duration tolerance, Supplier<T> call) {
        return retrying((Link) null, tolerance, call);
    }

    /**
     * Repeats {@code call} while Redis is unreachable or failing over, for at most {@code tolerance};
     * each error is shown to {@code link} (when not null) first, so it can find the new primary.
     */
    static <T> T retrying(Link link, Duration tolerance, Supplier<T> call) {
        return retrying(link == null ? e -> { } : link::recover, tolerance, call);
    }

    /** As {@link #retrying(Link, Duration, Supplier)}, each error shown to {@code onError} first. */
    static <T> T retrying(Consumer<RuntimeException> onError, Duration tolerance, Supplier<T> call) {
        long deadline = System.nanoTime() + tolerance.toNanos();
        long delay = 50;
        while (true) {
            try {
                return call.get();
            } catch (RuntimeException e) {
                onError.accept(e);
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

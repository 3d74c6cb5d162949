package io.kombuenvelope;

import io.lettuce.core.RedisClient;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.api.sync.RedisCommands;

import java.util.Locale;
import java.util.UUID;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.BeforeEach;

/**
 * A test class against the shared redis-server ({@link RedisServer#shared()}): one client and
 * connection for the class, a fresh key prefix for each test so that tests never see each other's keys.
 */
abstract class RedisFixture {
    /** The client of the shared server, for the builders under test. */
    static RedisClient client;
    private static StatefulRedisConnection<String, byte[]> conn;
    /** Commands on the shared server, to look at or arrange keys directly. */
    static RedisCommands<String, byte[]> redis;
    /** This test's prefix: the class name's first letter and eight hex digits, e.g. {@code a1b2c3d4e}. */
    String prefix;
    /** The keys under {@link #prefix}. */
    Keys keys;

    @BeforeAll
    static void connect() {
        client = Redis.client(RedisServer.shared().uri());
        conn = client.connect(Redis.CODEC);
        redis = conn.sync();
    }

    @AfterAll
    static void disconnect() {
        conn.close();
        client.shutdown();
    }

    @BeforeEach
    void freshPrefix() {
        prefix = getClass().getSimpleName().substring(0, 1).toLowerCase(Locale.ROOT)
                + UUID.randomUUID().toString().substring(0, 8);
        keys = new Keys(prefix);
    }
}

package io.kombuenvelope.drill;

import com.fasterxml.jackson.databind.ObjectMapper;
import io.lettuce.core.RedisClient;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.api.sync.RedisCommands;

import java.util.LinkedHashMap;
import java.util.Map;

/**
 * The drill's records of one run under {@code drill:<run>:} in the ledger Redis, as
 * {@code bench/drill/ledger.py} writes them: JSON objects with {@code pid}, {@code t} (epoch
 * seconds) and {@code host}. Calls are serialized: a MULTI on the shared connection holds no
 * other command.
 */
final class Ledger implements AutoCloseable {
    private static final ObjectMapper JSON = new ObjectMapper();

    private final RedisClient client;
    private final StatefulRedisConnection<String, String> connection;
    private final RedisCommands<String, String> redis;
    private final String run;
    private final String host;

    Ledger(String url, String run, String host) {
        this.client = RedisClient.create(url);
        this.connection = client.connect();
        this.redis = connection.sync();
        this.run = run;
        this.host = host;
    }

    private String key(String name) {
        return "drill:" + run + ":" + name;
    }

    private String record(Map<String, ?> fields) throws Exception {
        Map<String, Object> record = new LinkedHashMap<>();
        record.put("pid", ProcessHandle.current().pid());
        record.put("t", System.currentTimeMillis() / 1000.0);
        record.put("host", host);
        record.putAll(fields);
        return JSON.writeValueAsString(record);
    }

    /** Appends one record of {@code kind}. */
    synchronized void add(String kind, Map<String, ?> fields) throws Exception {
        redis.rpush(key(kind), record(fields));
    }

    /** Records the effect of {@code order}: its count and its record in one MULTI. */
    synchronized void addEffect(String task, String order) throws Exception {
        String record = record(Map.of("task", task, "order", order));
        redis.multi();
        redis.hincrby(key("effect-count"), order, 1);
        redis.rpush(key("effects"), record);
        if (redis.exec().wasDiscarded()) {
            throw new IllegalStateException("the effect's MULTI was discarded");
        }
    }

    @Override
    public void close() {
        connection.close();
        client.shutdown();
    }
}

package io.kombuenvelope.matrix;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.kombuenvelope.CancelResult;
import io.kombuenvelope.DeadLetters;
import io.kombuenvelope.Envelope;
import io.kombuenvelope.Producer;
import io.kombuenvelope.RetryPolicy;
import io.kombuenvelope.Timestamp;
import io.kombuenvelope.Worker;
import io.lettuce.core.RedisClient;
import io.lettuce.core.api.StatefulRedisConnection;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;

/**
 * The Java process of the cross-language matrix (tests/test_matrix.py), over the Java SDK as a
 * service uses it. It works the queues of {@code --work} with {@link MatrixHandler} and answers
 * JSON-line commands on stdin with one JSON line each on stdout:
 *
 * <pre>
 * {"id": 1, "op": "publish", "queue": Q, "tasks": [TASK, ...]}        -&gt; {"id": 1, "ok": true, "task_ids": [...]}
 * {"id": 2, "op": "replay", "queue": Q, "entry_id": E, "payload": {}} -&gt; {"id": 2, "ok": true, "entry_id": NEW}
 * {"id": 3, "op": "consume", "queue": Q}                              -&gt; {"id": 3, "ok": true}
 * {"id": 4, "op": "cancel", "task_ids": [...]}                         -&gt; {"id": 4, "ok": true, "outcomes": [{outcome, queue}]}
 * </pre>
 *
 * TASK is {task_id, task_type, payload, schedule_time, expires, max_retries (absent: 3, null:
 * unlimited), retry_policy, idempotency_key, ordering_key, headers (string values, e.g. traceparent
 * and tracestate)}. A failed command answers {"id": N, "ok": false, "error": "..."}. The process ends
 * when stdin closes. Workers write the results Celery callers ask for to the Redis of
 * {@code --results} (default {@code --redis}). Each worker runs up to {@code --concurrency} tasks at
 * once (default 1), {@code matrix.task} ({@link MatrixHandler}) and {@code limits.task}
 * ({@link LimitsHandler}).
 *
 * <pre>java -cp ... io.kombuenvelope.matrix.MatrixPeer --redis URL --prefix P [--work Q1,Q2,...] [--results URL]
 *     [--concurrency N]</pre>
 */
public final class MatrixPeer implements AutoCloseable {
    private static final ObjectMapper JSON = new ObjectMapper();

    private final String prefix;
    private final RedisClient client;
    private final RedisClient results;
    private final StatefulRedisConnection<String, String> connection;
    private final Producer producer;
    private final DeadLetters dead;
    private final List<Worker> workers = new ArrayList<>();
    private final int concurrency;

    private MatrixPeer(String redisUri, String prefix, String resultsUri, int concurrency) {
        this.prefix = prefix;
        this.concurrency = concurrency;
        this.client = RedisClient.create(redisUri);
        this.results = resultsUri == null ? client : RedisClient.create(resultsUri);
        this.connection = client.connect();
        this.producer = Producer.builder().client(client).prefix(prefix).build();
        this.dead = DeadLetters.builder().client(client).prefix(prefix).build();
    }

    public static void main(String[] args) throws Exception {
        String redis = null;
        String prefix = null;
        String work = "";
        String results = null;
        int concurrency = 1;
        for (int i = 0; i + 1 < args.length; i += 2) {
            switch (args[i]) {
                case "--redis" -> redis = args[i + 1];
                case "--prefix" -> prefix = args[i + 1];
                case "--work" -> work = args[i + 1];
                case "--results" -> results = args[i + 1];
                case "--concurrency" -> concurrency = Integer.parseInt(args[i + 1]);
                default -> throw new IllegalArgumentException("unknown argument " + args[i]);
            }
        }
        if (redis == null || prefix == null || args.length % 2 != 0) {
            System.err.println("usage: MatrixPeer --redis URL --prefix P [--work Q1,Q2,...] [--results URL]"
                    + " [--concurrency N]");
            System.exit(64);
        }
        try (MatrixPeer peer = new MatrixPeer(redis, prefix, results, concurrency)) {
            for (String queue : work.split(",")) {
                if (!queue.isEmpty()) {
                    peer.consume(queue);
                }
            }
            System.out.println(JSON.createObjectNode().put("ready", true).put("language", "java"));
            System.out.flush();
            BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
            for (String line = in.readLine(); line != null; line = in.readLine()) {
                System.out.println(peer.answer(line));
                System.out.flush();
            }
        }
        System.exit(0);
    }

    /** Starts a worker on {@code queue}; the first one also runs this process's promoter. */
    private void consume(String queue) {
        workers.add(Worker.builder().client(client).prefix(prefix).queue(queue).concurrency(concurrency)
                .lease(Duration.ofMillis(3000)).block(Duration.ofMillis(200))
                .deferDelay(Duration.ofMillis(300)).shutdownTimeout(Duration.ofSeconds(2))
                .retryPolicy(new RetryPolicy(2, Duration.ofMillis(200), Duration.ofMillis(1000)))
                .runPromoter(workers.isEmpty())
                .resultBackend(results)
                .resultHandler(MatrixHandler.TASK_TYPE, new MatrixHandler(connection.sync(), prefix, producer))
                .handler(LimitsHandler.TASK_TYPE, new LimitsHandler(connection.sync(), prefix))
                .build().start());
    }

    private ObjectNode answer(String line) {
        JsonNode command;
        try {
            command = JSON.readTree(line);
        } catch (Exception e) {
            return JSON.createObjectNode().put("ok", false).put("error", "command is not JSON: " + e.getMessage());
        }
        ObjectNode reply = JSON.createObjectNode().put("id", command.path("id").asLong()).put("ok", true);
        String queue = command.path("queue").asText();
        try {
            switch (command.path("op").asText()) {
                case "publish" -> {
                    var ids = reply.putArray("task_ids");
                    for (JsonNode task : command.path("tasks")) {
                        Envelope e = envelopeOf(task);
                        producer.publish(queue, e);
                        ids.add(e.taskId());
                    }
                }
                case "replay" -> {
                    JsonNode payload = command.get("payload");
                    reply.put("entry_id", dead.replay(queue, command.path("entry_id").asText(),
                            b -> payload == null ? b : b.payload((ObjectNode) payload), "matrix"));
                }
                case "consume" -> consume(queue);
                case "cancel" -> {
                    var outcomes = reply.putArray("outcomes");
                    for (JsonNode id : command.path("task_ids")) {
                        CancelResult r = producer.canceller().cancel(id.asText());
                        outcomes.addObject().put("outcome", r.outcome().word()).put("queue", r.queue());
                    }
                }
                default -> throw new IllegalArgumentException("unknown op " + command.path("op"));
            }
        } catch (RuntimeException e) {
            return JSON.createObjectNode().put("id", command.path("id").asLong()).put("ok", false)
                    .put("error", String.valueOf(e));
        }
        return reply;
    }

    /** The Envelope a TASK of a publish command describes. */
    private static Envelope envelopeOf(JsonNode task) {
        Envelope.Builder b = Envelope.builder(task.path("task_type").asText());
        if (task.hasNonNull("task_id")) {
            b.taskId(task.get("task_id").asText());
        }
        if (task.has("payload")) {
            b.payload((ObjectNode) task.get("payload"));
        }
        if (task.hasNonNull("schedule_time")) {
            b.scheduleTime(Timestamp.parse(task.get("schedule_time").asText()));
        }
        if (task.hasNonNull("expires")) {
            b.expires(Timestamp.parse(task.get("expires").asText()));
        }
        if (task.has("max_retries")) {
            b.maxRetries(task.get("max_retries").isNull() ? null : task.get("max_retries").asLong());
        }
        task.path("headers").fields().forEachRemaining(h -> b.header(h.getKey(), h.getValue().asText()));
        if (task.hasNonNull("retry_policy")) {
            b.header("x-retry-policy", task.get("retry_policy").asText());
        }
        if (task.hasNonNull("idempotency_key")) {
            b.idempotencyKey(task.get("idempotency_key").asText());
        }
        if (task.hasNonNull("ordering_key")) {
            b.orderingKey(task.get("ordering_key").asText());
        }
        return b.build();
    }

    @Override
    public void close() {
        for (Worker w : workers) {
            w.close();
        }
        producer.close();
        dead.close();
        connection.close();
        if (results != client) {
            results.shutdown();
        }
        client.shutdown();
    }
}

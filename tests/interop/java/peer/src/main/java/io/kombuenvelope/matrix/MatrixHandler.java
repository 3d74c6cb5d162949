package io.kombuenvelope.matrix;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.kombuenvelope.Envelope;
import io.kombuenvelope.Producer;
import io.kombuenvelope.Task;
import io.kombuenvelope.TaskFailure;
import io.kombuenvelope.ResultHandler;
import io.lettuce.core.api.sync.RedisCommands;

import java.util.Map;

/**
 * {@code matrix.task}, the handler every language of the cross-language matrix runs alike
 * (tests/interop/go/matrix.go, tests/interop/node/matrix-handler.js, tests/apps/matrix_app.py).
 * It records the attempt ({@code RPUSH <prefix>:mx:attempts:<task_id> "java:<retry_count>"}), with
 * {@code log} (a string) right after it {@code RPUSH <prefix>:mx:log:<log> "start <task_id>"}, and
 * the trace headers it came with ({@code RPUSH <prefix>:mx:trace:<task_id>} of the JSON
 * {@code {"language", "traceparent", "tracestate", "trace_id"}}); with {@code hold_ms} records
 * {@code <prefix>:mx:started:<task_id>} and waits; fails with {@link MatrixFailure} while
 * {@code fail} is true or for the first {@code fail_times} attempts; otherwise, with {@code log},
 * records {@code RPUSH <prefix>:mx:log:<log> "end <task_id>"}, then its effect
 * ({@code RPUSH <prefix>:mx:effect:<task_id> "java:<unix ms>"}), publishes each task of
 * {@code then} ({@code {"queue", "task_id", "then"}}) as a {@code matrix.task} whose payload's
 * {@code then} is the nested one, with the peer's producer on the handler thread (so it continues
 * the running task's trace), and returns {@code {"language": "java"}}, the result a Celery caller
 * receives.
 */
final class MatrixHandler implements ResultHandler {
    static final String TASK_TYPE = "matrix.task";
    private static final ObjectMapper JSON = new ObjectMapper();

    /** The error of a task asked to fail: not transient. */
    static final class MatrixFailure extends Exception {
        MatrixFailure(String message) {
            super(message);
        }
    }

    /** A command interface of a connection shared by the worker threads (Lettuce's are thread-safe). */
    private final RedisCommands<String, String> redis;
    private final String prefix;
    private final Producer producer;

    MatrixHandler(RedisCommands<String, String> redis, String prefix, Producer producer) {
        this.redis = redis;
        this.prefix = prefix;
        this.producer = producer;
    }

    @Override
    public Object handle(Task task) throws Exception {
        long holdMs = count(task, "hold_ms");
        long failTimes = count(task, "fail_times");
        JsonNode then = nextTasks(task.get("then"), "then");
        String log = text(task, "log");
        long attempt = redis.rpush(key("attempts", task), "java:" + task.retryCount());
        if (log != null) {
            redis.rpush(logKey(log), "start " + task.taskId());
        }
        Map<String, String> headers = task.envelope().headers();
        ObjectNode seen = JSON.createObjectNode().put("language", "java")
                .put("traceparent", headers.get("traceparent")).put("tracestate", headers.get("tracestate"))
                .put("trace_id", task.traceId());
        redis.rpush(key("trace", task), seen.toString());
        if (holdMs > 0) {
            redis.rpush(key("started", task), "java");
            Thread.sleep(holdMs);
        }
        if (task.get("fail").asBoolean(false) || attempt <= failTimes) {
            throw new MatrixFailure("matrix.task failed attempt " + attempt);
        }
        if (log != null) {
            redis.rpush(logKey(log), "end " + task.taskId());
        }
        redis.rpush(key("effect", task), "java:" + System.currentTimeMillis());
        for (JsonNode next : then) {
            ObjectNode payload = JSON.createObjectNode();
            payload.set("then", next.path("then").isArray() ? next.get("then") : JSON.createArrayNode());
            producer.publish(next.get("queue").asText(), Envelope.builder(TASK_TYPE)
                    .taskId(next.get("task_id").asText()).payload(payload).build());
        }
        return Map.of("language", "java");
    }

    private String key(String what, Task task) {
        return prefix + ":mx:" + what + ":" + task.taskId();
    }

    /** The list {@code <prefix>:mx:log:<log>} of the starts and ends of the tasks that name it. */
    private String logKey(String log) {
        return prefix + ":mx:log:" + log;
    }

    /** The string {@code payload.<name>}, null when absent. */
    private static String text(Task task, String name) throws TaskFailure.InvalidPayload {
        JsonNode value = task.get(name);
        if (value.isMissingNode() || value.isNull()) {
            return null;
        }
        if (!value.isTextual()) {
            throw new TaskFailure.InvalidPayload("payload." + name + " must be a string");
        }
        return value.asText();
    }

    private static long count(Task task, String name) throws TaskFailure.InvalidPayload {
        var value = task.get(name);
        if (value.isMissingNode() || value.isNull()) {
            return 0;
        }
        if (!value.canConvertToLong() || value.asLong() < 0) {
            throw new TaskFailure.InvalidPayload("payload." + name + " must be an integer >= 0");
        }
        return value.asLong();
    }

    private static boolean nonEmptyText(JsonNode value) {
        return value.isTextual() && !value.asText().isEmpty();
    }

    /** The tasks of {@code payload.<name>}, each {@code {"queue", "task_id", "then"}} checked; absent: none. */
    private static JsonNode nextTasks(JsonNode value, String name) throws TaskFailure.InvalidPayload {
        if (value.isMissingNode() || value.isNull()) {
            return JSON.createArrayNode();
        }
        String rule = "payload." + name
                + " must be a list of {\"queue\": non-empty string, \"task_id\": non-empty string, \"then\": list}";
        if (!value.isArray()) {
            throw new TaskFailure.InvalidPayload(rule);
        }
        for (int i = 0; i < value.size(); i++) {
            JsonNode next = value.get(i);
            if (!nonEmptyText(next.path("queue")) || !nonEmptyText(next.path("task_id"))) {
                throw new TaskFailure.InvalidPayload(rule);
            }
            nextTasks(next.path("then"), name + "[" + i + "].then");
        }
        return value;
    }
}

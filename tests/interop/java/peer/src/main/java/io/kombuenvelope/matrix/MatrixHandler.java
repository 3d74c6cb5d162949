package io.kombuenvelope.matrix;

import io.kombuenvelope.Task;
import io.kombuenvelope.TaskFailure;
import io.kombuenvelope.ResultHandler;
import io.lettuce.core.api.sync.RedisCommands;

import java.util.Map;

/**
 * {@code matrix.task}, the handler every language of the cross-language matrix runs alike
 * (tests/interop/go/matrix.go, tests/interop/node/matrix-handler.js, tests/apps/matrix_app.py).
 * It records the attempt ({@code RPUSH <prefix>:mx:attempts:<task_id> "java:<retry_count>"}); with
 * {@code hold_ms} records {@code <prefix>:mx:started:<task_id>} and waits; fails with
 * {@link MatrixFailure} while {@code fail} is true or for the first {@code fail_times} attempts;
 * otherwise
 * records its effect ({@code RPUSH <prefix>:mx:effect:<task_id> "java:<unix ms>"}) and returns
 * {@code {"language": "java"}}, the result a Celery caller receives.
 */
final class MatrixHandler implements ResultHandler {
    static final String TASK_TYPE = "matrix.task";

    /** The error of a task asked to fail: not transient. */
    static final class MatrixFailure extends Exception {
        MatrixFailure(String message) {
            super(message);
        }
    }

    /** A command interface of a connection shared by the worker threads (Lettuce's are thread-safe). */
    private final RedisCommands<String, String> redis;
    private final String prefix;

    MatrixHandler(RedisCommands<String, String> redis, String prefix) {
        this.redis = redis;
        this.prefix = prefix;
    }

    @Override
    public Object handle(Task task) throws Exception {
        long holdMs = count(task, "hold_ms");
        long failTimes = count(task, "fail_times");
        long attempt = redis.rpush(key("attempts", task), "java:" + task.retryCount());
        if (holdMs > 0) {
            redis.rpush(key("started", task), "java");
            Thread.sleep(holdMs);
        }
        if (task.get("fail").asBoolean(false) || attempt <= failTimes) {
            throw new MatrixFailure("matrix.task failed attempt " + attempt);
        }
        redis.rpush(key("effect", task), "java:" + System.currentTimeMillis());
        return Map.of("language", "java");
    }

    private String key(String what, Task task) {
        return prefix + ":mx:" + what + ":" + task.taskId();
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
}

package io.kombuenvelope.matrix;

import com.fasterxml.jackson.databind.ObjectMapper;
import io.kombuenvelope.Task;
import io.kombuenvelope.TaskFailure;
import io.kombuenvelope.TaskHandler;
import io.lettuce.core.api.sync.RedisCommands;

import java.time.Instant;

/**
 * {@code limits.task}, the handler of the limits matrix (docs/protocol.md section 19): sleeps
 * {@code payload.sleep_ms}, then records the attempt's span with {@code RPUSH <prefix>:mx:spans}
 * of the JSON {@code {"language": "java", "task_id", "start_ms", "end_ms"}} (unix ms).
 */
final class LimitsHandler implements TaskHandler {
    static final String TASK_TYPE = "limits.task";
    private static final ObjectMapper JSON = new ObjectMapper();

    private final RedisCommands<String, String> redis;
    private final String prefix;

    LimitsHandler(RedisCommands<String, String> redis, String prefix) {
        this.redis = redis;
        this.prefix = prefix;
    }

    @Override
    public void handle(Task task) throws Exception {
        double start = unixMs();
        var sleep = task.get("sleep_ms");
        if (!sleep.isIntegralNumber() || !sleep.canConvertToLong() || sleep.asLong() < 0) {
            throw new TaskFailure.InvalidPayload("payload.sleep_ms must be an integer >= 0");
        }
        Thread.sleep(sleep.asLong());
        double end = unixMs();
        redis.rpush(prefix + ":mx:spans", JSON.createObjectNode().put("language", "java").put("task_id", task.taskId())
                .put("start_ms", start).put("end_ms", end).toString());
    }

    /** Now, in ms since the epoch, to the clock's precision. */
    private static double unixMs() {
        Instant now = Instant.now();
        return now.getEpochSecond() * 1000.0 + now.getNano() / 1e6;
    }
}

package io.kombuenvelope;

import io.lettuce.core.Range;
import io.lettuce.core.cluster.api.sync.RedisClusterCommands;

import java.time.Instant;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeSet;

/**
 * Reads task records with the rules every reader uses (docs/protocol.md section 14): a scheduled
 * or retrying task that is due and no longer delayed is queued (promoted), a running one whose
 * worker has no liveness key is queued (taken over), a dead one whose dead-letter entry was purged
 * is failed, and without a record a task is scheduled when delayed, else unknown.
 */
final class TaskStates {
    private final RedisClusterCommands<String, byte[]> redis;
    private final Keys keys;

    TaskStates(RedisClusterCommands<String, byte[]> redis, Keys keys) {
        this.redis = redis;
        this.keys = keys;
    }

    /** The state of {@code taskId} in {@code queue}, or in every known queue when it is null. */
    TaskInfo get(String queue, String taskId) {
        Envelope.checkTaskId(taskId);
        List<String> queues = queue != null ? List.of(Keys.checkQueueName(queue)) : knownQueues();
        for (String q : queues) {
            Map<String, String> fields = new LinkedHashMap<>();
            redis.hgetall(keys.task(q, taskId)).forEach((k, v) -> fields.put(k, Redis.s(v)));
            if (!fields.isEmpty()) {
                return new TaskInfo(taskId, q, state(q, taskId, fields), fields);
            }
        }
        for (String q : queues) {
            if (isDelayed(q, taskId)) {
                return new TaskInfo(taskId, q, "scheduled", Map.of());
            }
        }
        return new TaskInfo(taskId, queue, "unknown", Map.of());
    }

    private String state(String queue, String taskId, Map<String, String> fields) {
        String state = fields.getOrDefault("state", "unknown");
        switch (state) {
            case "scheduled", "retrying" -> {
                Instant due;
                try {
                    due = Timestamp.parse(fields.get("due_at")).toInstant();
                } catch (RuntimeException e) {
                    return state;
                }
                return due.isAfter(Instant.now()) || isDelayed(queue, taskId) ? state : "queued";
            }
            case "running" -> {
                String worker = fields.get("worker");
                return worker == null || redis.exists(keys.consumer(worker)) == 1 ? state : "queued";
            }
            case "dead" -> {
                String id = fields.get("dead_id");
                return id == null || !redis.xrange(keys.dead(queue), Range.create(id, id)).isEmpty() ? state : "failed";
            }
            default -> {
                return state;
            }
        }
    }

    private boolean isDelayed(String queue, String taskId) {
        return redis.zscore(keys.delayed(queue), Redis.b(taskId)) != null;
    }

    /** The queues of the registries and of the announced workers, sorted. */
    List<String> knownQueues() {
        TreeSet<String> names = new TreeSet<>();
        for (String registry : List.of(keys.queues(), keys.deadQueues(), keys.periodicQueues())) {
            redis.smembers(registry).forEach(b -> names.add(Redis.s(b)));
        }
        Announcements.read(redis, keys).forEach(a -> names.addAll(a.queues()));
        return List.copyOf(names);
    }
}

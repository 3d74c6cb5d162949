package io.kombuenvelope;

/**
 * Runs one task. Return normally on success; throw to fail the attempt. Throw
 * {@link TaskFailure.InvalidPayload} or {@link TaskFailure.Rejected} for failures that no retry can
 * fix, {@link TaskFailure.Transient} for passing trouble, {@link TaskFailure.Retry} to ask for a
 * retry yourself (see docs/protocol.md section 8). A handler whose value is the task's result
 * for a Celery caller is a {@link ResultHandler}.
 */
@FunctionalInterface
public interface TaskHandler {
    void handle(Task task) throws Exception;
}

package io.kombuenvelope;

/**
 * Runs one task and returns its result: the value a Celery caller waiting for the task receives
 * (docs/protocol.md section 12), written as JSON by Jackson; null for none. Fails like a
 * {@link TaskHandler}, by throwing. Registered with {@link Worker.Builder#resultHandler}, so a
 * lambda is never ambiguous between the two.
 */
@FunctionalInterface
public interface ResultHandler {
    Object handle(Task task) throws Exception;
}

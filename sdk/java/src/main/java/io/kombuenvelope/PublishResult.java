package io.kombuenvelope;

/**
 * What a publish stored: the task's id, and the stream entry id when it went to a stream now
 * (null when it was stored in the delayed set).
 */
public record PublishResult(String taskId, String entryId, boolean delayed) {}

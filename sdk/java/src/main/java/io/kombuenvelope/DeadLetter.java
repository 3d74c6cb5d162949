package io.kombuenvelope;

import java.util.Map;

/**
 * One dead-letter entry (docs/protocol.md section 7): the failure fields, the original entry's
 * fields byte for byte ({@code raw.<field>} without the prefix), and its Envelope when it decodes
 * (else {@code decodeError} says why).
 */
public record DeadLetter(String queue, String entryId, Map<String, String> failure, Map<String, byte[]> raw,
                         Envelope envelope, String decodeError) {
    public String failureClass() { return failure.get("failure_class"); }
    public String reason() { return failure.get("reason"); }
    public String taskType() { return failure.get("task_type"); }
    public String taskId() { return failure.get("task_id"); }
}

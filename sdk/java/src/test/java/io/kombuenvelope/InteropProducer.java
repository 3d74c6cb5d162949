package io.kombuenvelope;

import com.fasterxml.jackson.databind.node.ObjectNode;

import java.time.Duration;
import java.time.Instant;
import java.time.ZoneOffset;

/**
 * The Java producer of the Python suite's cross-language test (tests/test_sdk_java.py): publishes
 * to {@code <queue>} one task now (priority 200, every optional field, an {@code ext} namespace
 * Java does not know), one delayed with a +08:00 schedule_time, and one gzip-compressed, then
 * prints their task ids as one JSON object.
 *
 * <pre>java -cp ... io.kombuenvelope.InteropProducer redis://127.0.0.1:PORT PREFIX QUEUE</pre>
 */
public final class InteropProducer {
    private InteropProducer() {}

    public static void main(String[] args) {
        if (args.length != 3) {
            System.err.println("usage: InteropProducer <redis-uri> <prefix> <queue>");
            System.exit(64);
        }
        try (Producer p = Producer.builder().redisUri(args[0]).prefix(args[1]).queue(args[2]).build()) {
            ObjectNode celery = Json.MAPPER.createObjectNode().put("root_id", "r-1").putNull("group");
            Envelope now = Envelope.builder("order.close_timeout").put("order_id", "202509110001").put("store_id", 7)
                    .priority(200).timeoutMs(30_000L).maxRetries(0L).idempotencyKey("202509110001")
                    .header("x-retry-policy", "tiered").ext("celery", celery).build();
            Envelope later = Envelope.builder("order.close_timeout").put("order_id", "later")
                    .scheduleTime(Timestamp.of(Instant.now().plus(Duration.ofHours(1)).atOffset(ZoneOffset.ofHours(8))))
                    .maxRetries(null).build();
            StringBuilder blob = new StringBuilder();
            for (int i = 0; i < 3000; i++) {
                blob.append("0123456789");
            }
            Envelope big = Envelope.builder("report.render").put("blob", blob.toString()).priority(10).build();
            p.publishAll(java.util.List.of(now, later, big));
            ObjectNode out = Json.MAPPER.createObjectNode();
            out.put("now", now.taskId());
            out.put("later", later.taskId());
            out.put("big", big.taskId());
            out.put("trace_id", now.traceId());
            System.out.println(out);
        }
    }
}

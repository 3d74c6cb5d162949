package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;

import org.junit.jupiter.api.Test;

/** The README's producer + worker example, run against the test Redis. */
class ReadmeExampleTest {
    @Test
    void theReadmeExampleRuns() throws Exception {
        String readme = Files.readString(Path.of("README.md"));
        String example = readme.substring(readme.indexOf("```java") + 8, readme.indexOf("```", readme.indexOf("```java") + 8));
        assertTrue(example.lines().count() <= 12, "the README example is about ten lines");
        assertTrue(example.contains("System.out.println(\"closing order \" + task.get(\"order_id\").asText())"));

        String uri = RedisServer.shared().uri();
        List<String> closed = new CopyOnWriteArrayList<>();
        // The README's lines, with the test's Redis and the println recorded.
        try (Producer producer = Producer.builder().redisUri(uri).queue("orders").build();
             Worker worker = Worker.builder().redisUri(uri).queue("orders")
                     .handler("order.close_timeout", task ->
                             closed.add("closing order " + task.get("order_id").asText()))
                     .closeOnShutdown(true)
                     .build().start()) {
            producer.publish(Envelope.builder("order.close_timeout").put("order_id", "202509110001")
                    .idempotencyKey("202509110001").build());
            Thread.sleep(1000);
        }
        assertEquals(List.of("closing order 202509110001"), closed);
    }
}

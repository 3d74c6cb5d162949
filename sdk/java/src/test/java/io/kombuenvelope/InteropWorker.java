package io.kombuenvelope;

import com.fasterxml.jackson.databind.node.ObjectNode;

import java.time.Duration;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;

/**
 * A Java worker for the Python suite's cross-language test (tests/test_sdk_java.py): runs tasks
 * of type {@code interop.echo} from {@code <queue>} and prints one JSON line per task run, then
 * exits after {@code <count>} runs (status 0) or {@code <timeout_s>} (status 2).
 *
 * <pre>java -cp ... io.kombuenvelope.InteropWorker redis://127.0.0.1:PORT PREFIX QUEUE COUNT TIMEOUT_S</pre>
 */
public final class InteropWorker {
    private InteropWorker() {}

    public static void main(String[] args) throws Exception {
        if (args.length != 5) {
            System.err.println("usage: InteropWorker <redis-uri> <prefix> <queue> <count> <timeout_s>");
            System.exit(64);
        }
        int count = Integer.parseInt(args[3]);
        CountDownLatch done = new CountDownLatch(count);
        Worker w = Worker.builder().redisUri(args[0]).prefix(args[1]).queue(args[2]).block(Duration.ofMillis(200))
                .shutdownTimeout(Duration.ofSeconds(5))
                .handler("interop.echo", task -> {
                    ObjectNode line = Json.MAPPER.createObjectNode();
                    line.put("task_id", task.taskId());
                    line.put("trace_id", task.traceId());
                    line.put("retry_count", task.retryCount());
                    line.set("payload", task.payload());
                    synchronized (System.out) {
                        System.out.println(Json.MAPPER.writeValueAsString(line));
                        System.out.flush();
                    }
                    done.countDown();
                })
                .build().start();
        boolean ok = done.await(Long.parseLong(args[4]), TimeUnit.SECONDS);
        Thread.sleep(300); // let the last acknowledgement land
        w.close();
        System.exit(ok ? 0 : 2);
    }
}

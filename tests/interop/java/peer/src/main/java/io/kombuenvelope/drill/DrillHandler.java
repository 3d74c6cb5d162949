package io.kombuenvelope.drill;

import io.kombuenvelope.Task;
import io.kombuenvelope.TaskFailure;
import io.kombuenvelope.TaskHandler;

import java.util.HashMap;
import java.util.Map;

/**
 * {@code drill.effect}, as {@code bench/drill/app.py} runs it for Celery: records the start
 * ({@code deliveries}) and the run ({@code runs}, with the idempotency key; the SDK's worker has made
 * the claim before it calls the handler), works {@code work_ms}, records the effect, then the
 * outcome: {@code returned}, since the worker writes the done marker and acknowledges after the
 * handler returns (Celery's {@code success} comes after its done marker).
 */
final class DrillHandler implements TaskHandler {
    static final String TASK_TYPE = "drill.effect";

    private final Ledger ledger;

    DrillHandler(Ledger ledger) {
        this.ledger = ledger;
    }

    @Override
    public void handle(Task task) throws Exception {
        var order = task.get("order_id");
        var work = task.get("work_ms");
        if (!order.isTextual() || !work.canConvertToLong() || work.asLong() < 0) {
            throw new TaskFailure.InvalidPayload(
                    "payload must hold order_id (a string) and work_ms (an integer >= 0)");
        }
        String id = task.taskId();
        try {
            ledger.add("deliveries", Map.of("task", id, "order", order.asText(),
                    "redelivered", task.redeliveries() > 0));
            Map<String, Object> run = new HashMap<>(Map.of("task", id, "order", order.asText()));
            run.put("key", task.envelope().idempotencyKey());
            ledger.add("runs", run);
            Thread.sleep(work.asLong());
            ledger.addEffect(id, order.asText());
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            ledger.add("outcomes", Map.of("task", id, "state", "failure", "error", "interrupted"));
            throw e;
        } catch (Exception e) {
            ledger.add("outcomes", Map.of("task", id, "state", "failure", "error", String.valueOf(e)));
            throw new TaskFailure.Transient("ledger: " + e, e);
        }
        ledger.add("outcomes", Map.of("task", id, "state", "returned"));
    }
}

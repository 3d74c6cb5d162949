package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.StatusCode;
import io.opentelemetry.context.Scope;
import io.opentelemetry.sdk.OpenTelemetrySdk;
import io.opentelemetry.sdk.testing.exporter.InMemorySpanExporter;
import io.opentelemetry.sdk.trace.SdkTracerProvider;
import io.opentelemetry.sdk.trace.data.SpanData;
import io.opentelemetry.sdk.trace.export.SimpleSpanProcessor;

import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;

import org.junit.jupiter.api.Test;

/** Trace context in headers and the send/process spans (docs/protocol.md section 18). */
class TracingTest extends RedisFixture {
    /** The Envelopes the handlers ran, by task type. */
    final Map<String, Envelope> ran = new ConcurrentHashMap<>();

    /**
     * A worker of queue {@code q} whose {@code parent} handler publishes a {@code child} with
     * {@code producer} and whose {@code boom} handler fails; {@code done} counts the children and booms.
     */
    Worker.Builder worker(Producer producer, CountDownLatch done) {
        return Worker.builder().client(client).prefix(prefix).queue("q").block(Duration.ofMillis(200))
                .lease(Duration.ofMillis(1500)).runPromoter(false).shutdownTimeout(Duration.ofSeconds(5))
                .handler("parent", t -> {
                    ran.put("parent", t.envelope());
                    producer.publish(Envelope.builder("child").build());
                })
                .handler("child", t -> {
                    ran.put("child", t.envelope());
                    done.countDown();
                })
                .handler("boom", t -> {
                    ran.put("boom", t.envelope());
                    done.countDown();
                    throw new TaskFailure.Rejected("boom");
                });
    }

    static SpanData span(List<SpanData> spans, String name, String taskId) {
        return spans.stream().filter(s -> s.getName().equals(name)
                        && taskId.equals(s.getAttributes().get(AttributeKey.stringKey("messaging.message.id"))))
                .findFirst().orElseThrow(() -> new AssertionError("no span " + name + " of " + taskId + " in " + spans));
    }

    static String traceparent(SpanData s) {
        return "00-" + s.getTraceId() + "-" + s.getSpanId() + "-" + s.getSpanContext().getTraceFlags().asHex();
    }

    @Test
    void withOpenTelemetryTheSpansFormOneTraceFromPublishThroughTheHandlerToItsChild() throws Exception {
        InMemorySpanExporter exporter = InMemorySpanExporter.create();
        SdkTracerProvider provider = SdkTracerProvider.builder()
                .addSpanProcessor(SimpleSpanProcessor.create(exporter)).build();
        OpenTelemetrySdk otel = OpenTelemetrySdk.builder().setTracerProvider(provider).build();
        CountDownLatch done = new CountDownLatch(2);
        String parentId;
        String boomId;
        try (Producer p = Producer.builder().client(client).prefix(prefix).queue("q").openTelemetry(otel).build();
             Worker w = worker(p, done).openTelemetry(otel).build().start()) {
            Span request = otel.getTracer("test").spanBuilder("request").startSpan();
            try (Scope s = request.makeCurrent()) {
                Envelope parent = Envelope.builder("parent").build();
                assertEquals(request.getSpanContext().getTraceId(), parent.traceId(),
                        "a new task in a trace gets its trace id");
                parentId = p.publish(parent).taskId();
                boomId = p.publish(Envelope.builder("boom").build()).taskId();
            } finally {
                request.end();
            }
            assertTrue(done.await(10, TimeUnit.SECONDS), "the child and the failing task ran");
        }
        List<SpanData> spans = exporter.getFinishedSpanItems();
        otel.close();
        String trace = request(spans).getTraceId();
        SpanData sendParent = span(spans, "send q", parentId);
        SpanData processParent = span(spans, "process q", parentId);
        String childId = ran.get("child").taskId();
        SpanData sendChild = span(spans, "send q", childId);
        SpanData processChild = span(spans, "process q", childId);

        assertEquals(request(spans).getSpanId(), sendParent.getParentSpanId());
        assertEquals(SpanKind.PRODUCER, sendParent.getKind());
        assertEquals(traceparent(sendParent), ran.get("parent").headers().get("traceparent"),
                "the send span's context is what traceparent carries");
        assertEquals(SpanKind.CONSUMER, processParent.getKind());
        assertEquals(sendParent.getSpanId(), processParent.getParentSpanId(), "process is a child of the traceparent");
        assertEquals(processParent.getSpanId(), sendChild.getParentSpanId(), "a publish from the handler continues");
        assertEquals(traceparent(sendChild), ran.get("child").headers().get("traceparent"));
        assertEquals(sendChild.getSpanId(), processChild.getParentSpanId());
        for (SpanData s : List.of(sendParent, processParent, sendChild, processChild)) {
            assertEquals(trace, s.getTraceId(), s.getName());
        }
        assertEquals(trace, ran.get("child").traceId(), "the child's trace_id is the trace's");

        assertEquals("kombu_envelope", processParent.getAttributes().get(AttributeKey.stringKey("messaging.system")));
        assertEquals("process", processParent.getAttributes().get(AttributeKey.stringKey("messaging.operation.type")));
        assertEquals("send", sendParent.getAttributes().get(AttributeKey.stringKey("messaging.operation.type")));
        assertEquals("q", sendParent.getAttributes().get(AttributeKey.stringKey("messaging.destination.name")));
        assertEquals("parent", processParent.getAttributes().get(AttributeKey.stringKey("kombu_envelope.task_type")));
        assertEquals(0L, processParent.getAttributes().get(AttributeKey.longKey("kombu_envelope.retry_count")));
        assertEquals(StatusCode.UNSET, processParent.getStatus().getStatusCode());

        SpanData boom = span(spans, "process q", boomId);
        assertEquals(StatusCode.ERROR, boom.getStatus().getStatusCode());
        assertTrue(boom.getEvents().stream().anyMatch(e -> e.getName().equals("exception")), "exception recorded");
    }

    private static SpanData request(List<SpanData> spans) {
        return spans.stream().filter(s -> s.getName().equals("request")).findFirst().orElseThrow();
    }

    @Test
    void withoutAnOpenTelemetrySdkTheRunningTasksTraceContextPassesOnUnchanged() throws Exception {
        CountDownLatch done = new CountDownLatch(1);
        String traceId = "4bf92f3577b34da6a3ce929d0e0e4736";
        String incoming = "00-" + traceId + "-00f067aa0ba902b7-01";
        try (Producer p = Producer.builder().client(client).prefix(prefix).queue("q").build();
             Worker w = worker(p, done).build().start()) {
            String plain = p.publish("idle", Envelope.builder("child").build()).entryId();
            var entry = redis.xrange(keys.stream("idle", "normal"), io.lettuce.core.Range.create(plain, plain)).get(0);
            assertEquals(Map.of(), EntryCodec.decodeEntry(entry.getBody(), Limits.DEFAULT).headers(),
                    "outside any trace, nothing is written");
            Envelope parent = Envelope.builder("parent").header("traceparent", incoming)
                    .header("tracestate", "vendor=1").build();
            assertEquals(traceId, parent.traceId(), "trace_id defaults to the traceparent's trace id");
            p.publish(parent);
            assertTrue(done.await(10, TimeUnit.SECONDS), "the child ran");
        }
        Envelope child = ran.get("child");
        assertNotNull(child);
        assertEquals(incoming, child.headers().get("traceparent"), "copied unchanged");
        assertEquals("vendor=1", child.headers().get("tracestate"));
        assertEquals(traceId, child.traceId());
    }

    @Test
    void anInvalidTraceparentIsIgnoredNeverARefusal() throws Exception {
        CountDownLatch done = new CountDownLatch(1);
        try (Producer p = Producer.builder().client(client).prefix(prefix).queue("q").build();
             Worker w = worker(p, done).build().start()) {
            Envelope parent = Envelope.builder("parent").traceId("req-7").header("traceparent", "not-a-traceparent")
                    .build();
            p.publish(parent);
            assertTrue(done.await(10, TimeUnit.SECONDS), "the task ran and its child too");
        }
        Envelope child = ran.get("child");
        assertFalse(child.headers().containsKey("traceparent"), "nothing valid to pass on: " + child.headers());
        assertEquals("req-7", child.traceId(), "the child keeps the running task's trace_id");
        assertNull(Tracing.traceIdOf("00-00000000000000000000000000000000-00f067aa0ba902b7-01"), "all-zero id");
        assertNull(Tracing.traceIdOf("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), "version ff");
    }
}

package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.RedisConnectionException;

import java.time.Duration;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * The SDK over TLS to real redis-servers that speak only TLS (their plain ports are closed, so
 * every connection that works is a TLS one): one server, a Sentinel group, a Cluster.
 */
@Timeout(value = 60, unit = TimeUnit.SECONDS)
class TlsTest {
    static Tls tls;
    static RedisServer server;

    @BeforeAll
    static void start() throws Exception {
        tls = Tls.make();
        server = RedisServer.startWith(tls);
        // The JVM's first TLS connection loads and starts what every later one reuses (seconds on a
        // busy machine): paid here, so a refusal's time below is its own.
        Producer.builder().redisUri(url(server, tls.caQuery())).queue("jobs").build().close();
    }

    @AfterAll
    static void stop() {
        if (server != null) {
            server.stop();
        }
    }

    static String url(RedisServer s, String query) {
        return "rediss://127.0.0.1:" + s.port + (query.isEmpty() ? "" : "?" + query);
    }

    /** Publishes one task with a Producer on {@code producerUrl} and waits until a Worker on {@code workerUrl} ran it. */
    static void publishAndRun(String producerUrl, String workerUrl) throws Exception {
        String prefix = "t" + UUID.randomUUID().toString().substring(0, 8);
        Set<String> ran = ConcurrentHashMap.newKeySet();
        try (Producer p = Producer.builder().redisUri(producerUrl).prefix(prefix).queue("jobs").build();
             Worker w = Worker.builder().redisUri(workerUrl).prefix(prefix).queue("jobs").block(Duration.ofMillis(200))
                     .lease(Duration.ofMillis(1500)).handler("job.run", t -> ran.add(t.get("k").asText())).build().start()) {
            p.publish(Envelope.builder("job.run").put("k", "over tls").build());
            SentinelGroup.await("the task ran", () -> ran.contains("over tls"));
        }
    }

    /** The error of building a Producer on {@code url}, which must come at once, not after retries. */
    static RedisConnectionException refused(String url) {
        long start = System.nanoTime();
        RedisConnectionException e = assertThrows(RedisConnectionException.class,
                () -> Producer.builder().redisUri(url).queue("jobs").build().close());
        long ms = (System.nanoTime() - start) / 1_000_000;
        assertTrue(ms < 3000, "the refusal took " + ms + " ms");
        assertTrue(e.getMessage().startsWith("TLS handshake failed"), e.getMessage());
        assertTrue(e.getMessage().contains("certificat"), e.getMessage());
        return e;
    }

    @Test
    void aProducerAndAWorkerCheckTheServerCertificateAgainstTheCa() throws Exception {
        String u = url(server, tls.caQuery());
        publishAndRun(u, u);
    }

    @Test
    void aCertificateFromAnotherCaOrNoCaIsRefusedAtOnce() {
        refused(url(server, "ssl_ca_certs=" + tls.otherCa));
        refused(url(server, ""));
        refused(url(server, "ssl_cert_reqs=required"));
    }

    @Test
    void sslCertReqsNoneSkipsTheCheck() throws Exception {
        String u = url(server, "ssl_cert_reqs=none");
        publishAndRun(u, u);
    }

    @Test
    void aServerAskingForClientCertificatesGetsTheOneNamed() throws Exception {
        RedisServer strict = RedisServer.startWith(tls, "--tls-auth-clients", "yes");
        try {
            String u = url(strict, tls.caQuery() + "&ssl_certfile=" + tls.clientCert + "&ssl_keyfile=" + tls.clientKey);
            publishAndRun(u, u);
            assertTrue(refused(url(strict, tls.caQuery())).getMessage().contains("certificate_required"));
        } finally {
            strict.stop();
        }
    }

    @Test
    void aWrongTlsOptionNamesItself() {
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                () -> RedisUrl.parse("redis://127.0.0.1:1?ssl_ca_certs=" + tls.ca));
        assertTrue(e.getMessage().contains("ssl_ca_certs need TLS"), e.getMessage());
        e = assertThrows(IllegalArgumentException.class,
                () -> RedisUrl.parse("rediss-cluster://127.0.0.1:1?ssl_ca_certs=/no/such/ca.pem"));
        assertTrue(e.getMessage().contains("ssl_ca_certs \"/no/such/ca.pem\" is not a readable file"), e.getMessage());
        e = assertThrows(IllegalArgumentException.class,
                () -> RedisUrl.parse("rediss://127.0.0.1:1?ssl_cert_reqs=optional"));
        assertTrue(e.getMessage().contains("ssl_cert_reqs \"optional\" is not required or none"), e.getMessage());
        e = assertThrows(IllegalArgumentException.class,
                () -> RedisUrl.parse("rediss-sentinel://127.0.0.1:1?ssl_certfile=" + tls.clientCert + "#m"));
        assertTrue(e.getMessage().contains("ssl_certfile and ssl_keyfile go together"), e.getMessage());
    }

    @Test
    void sentinelsAndDataNodesBothOverTls() throws Exception {
        try (SentinelGroup g = SentinelGroup.start(tls, 1)) {
            assertTrue(g.url().startsWith("rediss-sentinel://"), g.url());
            publishAndRun(g.url(), g.url());
            assertEquals(g.data.get(0).port, g.primaryPort(), "the sentinels name the TLS primary");
            String wrongCa = g.url().replace(tls.caQuery(), "ssl_ca_certs=" + tls.otherCa);
            refused(wrongCa);
        }
    }

    @Test
    void aClusterOverTls() throws Exception {
        try (ClusterGroup c = ClusterGroup.start(tls, 0)) {
            publishAndRun(c.url(), c.url());
            refused(c.url().replace(tls.caQuery(), "ssl_ca_certs=" + tls.otherCa));
        }
    }
}

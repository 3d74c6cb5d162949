package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.RedisCredentials;
import io.lettuce.core.RedisURI;

import java.util.List;

import org.junit.jupiter.api.Test;

/** The URL forms of Sentinel and Cluster, and what an invalid URL says (pure parsing, no server). */
class RedisUrlTest {
    @Test
    void aSentinelUrlNamesItsSentinelsMasterDatabaseAndCredentials() {
        RedisUrl u = RedisUrl.parse("redis-sentinel://app:s%40cret@h1,h2:26380,[::1]:26381/3"
                + "?sentinel_username=watch&sentinel_password=pw#mymaster");
        assertEquals(RedisUrl.Kind.SENTINEL, u.kind());
        RedisURI uri = u.uris().get(0);
        assertEquals("mymaster", uri.getSentinelMasterId());
        assertEquals(3, uri.getDatabase());
        assertEquals("app", user(uri));
        assertEquals("s@cret", password(uri));
        assertFalse(uri.isSsl());
        List<RedisURI> s = uri.getSentinels();
        assertEquals(List.of("h1:26379", "h2:26380", "::1:26381"),
                s.stream().map(x -> x.getHost() + ":" + x.getPort()).toList());
        assertEquals("watch", user(s.get(0)));
        assertEquals("pw", password(s.get(2)));
    }

    @Test
    void rediss() {
        RedisURI uri = RedisUrl.parse("rediss-sentinel://:pw@h1#m").uris().get(0);
        assertTrue(uri.isSsl());
        assertTrue(uri.getSentinels().get(0).isSsl(), "TLS to the sentinels too");
        assertNull(user(uri));
        assertEquals("pw", password(uri));
        assertNull(password(uri.getSentinels().get(0)), "no sentinel password unless given");
        List<RedisURI> seeds = RedisUrl.parse("rediss-cluster://u:p@a:7000,b").uris();
        assertEquals(List.of("a:7000", "b:6379"), seeds.stream().map(x -> x.getHost() + ":" + x.getPort()).toList());
        assertTrue(seeds.stream().allMatch(RedisURI::isSsl));
        assertEquals("u", user(seeds.get(1)));
        assertEquals(RedisUrl.Kind.SINGLE, RedisUrl.parse("rediss://h:6380/2").kind());
        assertTrue(RedisUrl.parse("rediss://h:6380/2").uris().get(0).isSsl());
    }

    @Test
    void anInvalidUrlFailsNamingThePartThatIsWrong() {
        assertError("redis-sentinel://h1,h2", "master_name");
        assertError("redis-sentinel://h1#m?sentinel_password=x", "master_name \"m?sentinel_password=x\" contains '?'");
        assertError("redis-sentinel://h1?x=1#m", "query unknown option \"x\"");
        assertError("redis-sentinel://h1?sentinel_username=u#m", "query sentinel_username needs sentinel_password");
        assertError("redis-sentinel://h1:0#m", "port \"0\"");
        assertError("redis-sentinel://h1,:26379#m", "host empty host");
        assertError("redis-sentinel://h1/x#m", "database \"x\"");
        assertError("redis-sentinel://secret@h1#m", "userinfo");
        assertError("redis-cluster://", "host at least one host");
        assertError("redis-cluster://h1:abc", "port \"abc\"");
        assertError("redis-cluster://h1/1", "database Redis Cluster has only database 0");
        assertError("redis-cluster://h1#m", "fragment");
        assertError("redis-cluster://h1?sentinel_password=x", "query");
        assertError("mongodb://h1", "scheme \"mongodb\"");
        assertError("h1:6379", "scheme missing");
        assertError("redis://h1:notaport", "port \"notaport\"");
        assertError("redis://", "syntax Expected authority");
    }

    @Test
    void aPasswordNeverShowsInAnError() {
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                () -> RedisUrl.parse("redis-sentinel://u:hunter2@h1?sentinel_password=hunter3&x=1#m"));
        assertFalse(e.getMessage().contains("hunter"), e.getMessage());
    }

    @Test
    void theBuildersCheckTheUrlAtOnce() {
        assertThrows(IllegalArgumentException.class, () -> Producer.builder().redisUri("redis-cluster://h1/2"));
        assertThrows(IllegalArgumentException.class, () -> Worker.builder().redisUri("redis-sentinel://h1"));
        assertThrows(IllegalArgumentException.class, () -> Promoter.builder().redisUri("redis-sentinel://h1"));
        assertThrows(IllegalArgumentException.class, () -> Canceller.builder().redisUri("x"));
        assertThrows(IllegalArgumentException.class, () -> DeadLetters.builder().redisUri("x"));
        assertThrows(IllegalArgumentException.class, () -> Producer.builder().waitReplicas(-1, java.time.Duration.ZERO));
    }

    private static String user(RedisURI u) {
        RedisCredentials c = u.getCredentialsProvider().resolveCredentials().block();
        return c == null ? null : c.getUsername();
    }

    private static String password(RedisURI u) {
        RedisCredentials c = u.getCredentialsProvider().resolveCredentials().block();
        return c == null || !c.hasPassword() ? null : new String(c.getPassword());
    }

    private static void assertError(String url, String part) {
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class, () -> RedisUrl.parse(url), url);
        assertTrue(e.getMessage().contains(part), e.getMessage());
    }
}

package io.kombuenvelope;

import io.lettuce.core.RedisNoScriptException;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.cluster.api.sync.RedisClusterCommands;

import java.io.IOException;
import java.io.InputStream;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.HexFormat;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;

/**
 * The protocol's Lua scripts, loaded from the jar (copies of kombu_envelope/lua written by
 * sdk/sync_lua.py), run with EVALSHA and loaded again on NOSCRIPT. Never re-implemented.
 */
final class Scripts {
    private static final List<String> NAMES = List.of("enqueue", "schedule", "promote", "read", "requeue", "dead_letter",
            "retry", "cancel", "idem_begin", "idem_finish", "retry_slot", "forget_consumer", "replay");
    private static final String RESOURCE_DIR = "/io/kombuenvelope/lua/";

    record Script(String name, String source, String sha) {}

    private static final Map<String, Script> SCRIPTS = load();

    private Scripts() {}

    private static Map<String, Script> load() {
        Map<String, Script> out = new TreeMap<>();
        for (String name : NAMES) {
            String path = RESOURCE_DIR + name + ".lua";
            try (InputStream in = Scripts.class.getResourceAsStream(path)) {
                if (in == null) {
                    throw new IllegalStateException("Lua script " + path + " missing from the classpath "
                            + "(run python sdk/sync_lua.py)");
                }
                String src = new String(in.readAllBytes(), StandardCharsets.UTF_8);
                out.put(name, new Script(name, src, sha1(src)));
            } catch (IOException e) {
                throw new UncheckedIOException(e);
            }
        }
        return out;
    }

    private static String sha1(String src) {
        try {
            return HexFormat.of().formatHex(MessageDigest.getInstance("SHA-1").digest(src.getBytes(StandardCharsets.UTF_8)));
        } catch (NoSuchAlgorithmException e) {
            throw new IllegalStateException(e);
        }
    }

    static Script get(String name) {
        Script s = SCRIPTS.get(name);
        if (s == null) {
            throw new IllegalArgumentException("unknown script " + name);
        }
        return s;
    }

    /**
     * Runs a script with EVALSHA (a cluster client routes it by its first key); a node that does
     * not know it yet (NOSCRIPT: a new primary, a restart) gets the source with EVAL, which also
     * caches it there. Arguments are Strings, byte[] or numbers.
     */
    @SuppressWarnings("unchecked")
    static <T> T run(RedisClusterCommands<String, byte[]> redis, String name, ScriptOutputType type, List<String> keys,
                     Object... args) {
        Script s = get(name);
        String[] k = keys.toArray(new String[0]);
        byte[][] a = new byte[args.length][];
        for (int i = 0; i < args.length; i++) {
            a[i] = arg(args[i]);
        }
        try {
            return (T) redis.evalsha(s.sha(), type, k, a);
        } catch (RedisNoScriptException e) {
            return (T) redis.eval(s.source(), type, k, a);
        }
    }

    static byte[] arg(Object o) {
        if (o instanceof byte[]) {
            return (byte[]) o;
        }
        return String.valueOf(o).getBytes(StandardCharsets.UTF_8);
    }
}

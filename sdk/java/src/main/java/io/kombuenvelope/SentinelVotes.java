package io.kombuenvelope;

import io.lettuce.core.RedisConnectionException;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.StringJoiner;

/**
 * One lookup of a Sentinel group's primary: what each listed sentinel named for {@code master_name},
 * and the address more than half of them name (docs/protocol.md section 5, failover). A sentinel
 * counts only when its state for the primary is sane: flagged {@code master}, neither
 * {@code s_down} nor {@code o_down}. Not thread-safe: its user serializes the calls.
 */
final class SentinelVotes {
    /** A host and port: a sentinel, or the primary one names. */
    record Address(String host, int port) {
        @Override
        public String toString() {
            return (host.contains(":") ? "[" + host + "]" : host) + ":" + port;
        }
    }

    private final String master;
    /** What each sentinel said, in the order they are listed (null: no answer yet). */
    private final Map<String, String> said = new LinkedHashMap<>();
    private final Map<Address, Integer> votes = new HashMap<>();
    private final List<Throwable> errors = new ArrayList<>();
    private int pending;

    /** A lookup of {@code master} asking the sentinels named {@code sentinels} ({@code host:port}). */
    SentinelVotes(String master, List<String> sentinels) {
        this.master = master;
        sentinels.forEach(s -> said.put(s, null));
        this.pending = said.size();
    }

    /** How many sentinels must name the same primary: more than half of those listed. */
    int needed() {
        return said.size() / 2 + 1;
    }

    /** Records the {@code SENTINEL MASTER} reply of {@code sentinel} (a sentinel listed twice counts once). */
    void named(String sentinel, Map<String, String> state) {
        if (said.get(sentinel) != null) {
            return;
        }
        String ip = state.get("ip");
        String port = state.get("port");
        if (ip == null || port == null || !port.matches("[0-9]{1,5}")) {
            answer(sentinel, "answered an unreadable state " + state);
            return;
        }
        Address p = new Address(ip, Integer.parseInt(port));
        String flags = state.getOrDefault("flags", "");
        List<String> f = List.of(flags.split(","));
        if (!f.contains("master") || f.contains("s_down") || f.contains("o_down")) {
            answer(sentinel, "named " + p + " with flags " + flags + " (not counted)");
            return;
        }
        votes.merge(p, 1, Integer::sum);
        answer(sentinel, "named " + p);
    }

    /** Records that {@code sentinel} could not be asked, or refused ({@code ERR No such master ...}). */
    void failed(String sentinel, Throwable error) {
        if (said.get(sentinel) != null) {
            return;
        }
        errors.add(error);
        Throwable root = error;
        while (root.getCause() != null && root.getCause() != root) {
            root = root.getCause();
        }
        answer(sentinel, "failed (" + (root.getMessage() != null ? root.getMessage() : root.toString()) + ")");
    }

    private void answer(String sentinel, String what) {
        said.put(sentinel, what);
        pending--;
    }

    /** The primary a majority names, or null. */
    Address majority() {
        return votes.entrySet().stream().filter(e -> e.getValue() >= needed()).map(Map.Entry::getKey)
                .findFirst().orElse(null);
    }

    /** Whether the outcome is known: a majority names a primary, or none can even with the answers still due. */
    boolean decided() {
        int best = votes.values().stream().max(Integer::compare).orElse(0);
        return best >= needed() || best + pending < needed();
    }

    /**
     * The error of a lookup without a majority: a connection error (an outage, retried like
     * "all sentinels unreachable"). Its cause is a sentinel's refused TLS handshake if there was one
     * (that is no outage: {@link Redis#isOutage}), else the last sentinel's error; Lettuce keeps
     * only the cause when it reports a failed connection, so the other errors are suppressed ones.
     */
    RedisConnectionException noMajority() {
        StringJoiner each = new StringJoiner(", ");
        said.forEach((sentinel, what) -> each.add(sentinel + " " + (what == null ? "had not answered" : what)));
        Throwable cause = errors.stream().filter(e -> Redis.tlsFailure(e) != null).findFirst()
                .orElse(errors.isEmpty() ? null : errors.get(errors.size() - 1));
        RedisConnectionException e = new RedisConnectionException("no primary for master_name \"" + master + "\": "
                + needed() + " of the " + said.size() + " listed sentinels must name the same one; " + each, cause);
        errors.stream().filter(s -> s != cause).forEach(e::addSuppressed);
        return e;
    }
}

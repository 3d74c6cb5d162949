package io.kombuenvelope;

import java.io.File;
import java.io.IOException;
import java.net.ServerSocket;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.concurrent.TimeUnit;

/** A private redis-server on a free loopback port (never 6379), shared by the tests of one JVM. */
final class RedisServer {
    private static RedisServer shared;

    final int port;
    private final Process process;
    private final Path dir;

    private RedisServer() throws IOException, InterruptedException {
        this(0);
    }

    /** A server of its own (not shared), on {@code fixedPort} when not 0. */
    static RedisServer startPrivate(int fixedPort) throws IOException, InterruptedException {
        return new RedisServer(fixedPort);
    }

    /**
     * A server of its own in {@code dir} (a new directory when null) on {@code fixedPort} (a free
     * one when 0) that appends every write to its AOF and syncs it at once, so a SIGKILL loses
     * nothing and a server started again on the same port and directory has every entry back.
     */
    static RedisServer durable(int fixedPort, Path dir) throws IOException, InterruptedException {
        return new RedisServer(fixedPort, dir, null,
                (d, port) -> List.of("--appendonly", "yes", "--appendfsync", "always"));
    }

    /** A server of its own on a free port, with more arguments ({@code --replicaof ...}, {@code --cluster-enabled yes}). */
    static RedisServer startWith(String... args) throws IOException, InterruptedException {
        return startWith(null, args);
    }

    /**
     * A server of its own on a free port that speaks only TLS with the certificates of {@code tls}
     * (its plain port is closed; plain TCP when null), with more arguments.
     */
    static RedisServer startWith(Tls tls, String... args) throws IOException, InterruptedException {
        return new RedisServer(0, null, tls, (dir, port) -> List.of(args));
    }

    /**
     * A sentinel on a free port that monitors {@code masterName} at {@code masterPort}, quorum 2, with
     * a short down-after (2 s) and failover timeout (3 s); it asks clients (and its peers) for
     * {@code password} and logs in to the data nodes with {@code dataPassword}.
     */
    static RedisServer sentinel(String masterName, int masterPort, String dataPassword, String password)
            throws IOException, InterruptedException {
        return sentinel(null, masterName, masterPort, dataPassword, password);
    }

    /** The same sentinel, speaking only TLS (to its clients, its peers and the data nodes) when {@code tls}. */
    static RedisServer sentinel(Tls tls, String masterName, int masterPort, String dataPassword, String password)
            throws IOException, InterruptedException {
        return sentinel(tls, masterName, masterPort, 2, dataPassword, password);
    }

    /** The same sentinel with {@code quorum} instead of 2. */
    static RedisServer sentinel(Tls tls, String masterName, int masterPort, int quorum, String dataPassword,
                                String password) throws IOException, InterruptedException {
        return new RedisServer(0, null, tls, (dir, port) -> {
            Path conf = dir.resolve("sentinel.conf");
            Files.writeString(conf, String.join("\n",
                    "requirepass " + password,
                    "sentinel monitor " + masterName + " 127.0.0.1 " + masterPort + " " + quorum,
                    "sentinel auth-pass " + masterName + " " + dataPassword,
                    "sentinel down-after-milliseconds " + masterName + " 2000",
                    "sentinel failover-timeout " + masterName + " 3000",
                    "sentinel parallel-syncs " + masterName + " 1", ""));
            return List.of(conf.toString(), "--sentinel");
        });
    }

    /** The arguments that make a server a particular kind, given its directory and port; may write files there. */
    private interface Kind {
        List<String> args(Path dir, int port) throws IOException;
    }

    private RedisServer(int fixedPort) throws IOException, InterruptedException {
        this(fixedPort, null, null, (dir, port) -> List.of());
    }

    private RedisServer(int fixedPort, Path inDir, Tls tls, Kind kind) throws IOException, InterruptedException {
        dir = inDir != null ? inDir : Files.createTempDirectory("kombu-envelope-redis");
        String bin = System.getProperty("kombuenvelope.redis.server", "redis-server");
        IOException last = null;
        for (int attempt = 0; attempt < 5; attempt++) {
            int p = fixedPort != 0 ? fixedPort : freePort();
            List<String> kindArgs = kind.args(dir, p);
            List<String> command = new java.util.ArrayList<>();
            command.add(bin);
            boolean configFirst = !kindArgs.isEmpty() && !kindArgs.get(0).startsWith("--");
            if (configFirst) {
                command.add(kindArgs.get(0));
            }
            command.addAll(tls == null ? List.of("--port", String.valueOf(p))
                    : List.of("--port", "0", "--tls-port", String.valueOf(p)));
            if (tls != null) {
                command.addAll(tls.serverArgs());
            }
            command.addAll(List.of("--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", dir.toString()));
            command.addAll(configFirst ? kindArgs.subList(1, kindArgs.size()) : kindArgs);
            ProcessBuilder pb = new ProcessBuilder(command)
                    .redirectErrorStream(true).redirectOutput(dir.resolve("redis.log").toFile());
            Process proc = pb.start();
            Resp.tls(p, tls == null ? null : tls.context);
            if (waitForPort(p, proc)) {
                this.port = p;
                this.process = proc;
                Runtime.getRuntime().addShutdownHook(new Thread(this::stopQuietly));
                return;
            }
            proc.destroyForcibly();
            Resp.tls(p, null);
            last = new IOException("redis-server did not start on port " + p + ": "
                    + Files.readString(dir.resolve("redis.log")));
        }
        throw last;
    }

    static synchronized RedisServer shared() {
        if (shared == null) {
            try {
                shared = new RedisServer();
            } catch (IOException | InterruptedException e) {
                throw new IllegalStateException("cannot start redis-server (is it installed?)", e);
            }
        }
        return shared;
    }

    /** The directory holding its files (AOF, log). */
    Path dir() {
        return dir;
    }

    String uri() {
        return "redis://127.0.0.1:" + port;
    }

    private static int freePort() throws IOException {
        try (ServerSocket s = new ServerSocket(0)) {
            s.setReuseAddress(true);
            int p = s.getLocalPort();
            return p == 6379 ? freePort() : p;
        }
    }

    private static boolean waitForPort(int port, Process proc) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (System.nanoTime() < deadline) {
            if (!proc.isAlive()) {
                return false;
            }
            try {
                Resp.at(port).call("PING");
                return true;
            } catch (IllegalStateException e) {
                if (e.getMessage().startsWith("NOAUTH")) { // up, and asks for a password
                    return true;
                }
            } catch (IOException e) {
                // not yet
            }
            Thread.sleep(20);
        }
        return false;
    }

    private void stopQuietly() {
        if (process.isAlive()) {
            stop();
        }
    }

    /** SIGKILL: the server dies at once, with whatever it had not replicated. */
    void kill() throws InterruptedException {
        process.destroyForcibly();
        process.waitFor(5, TimeUnit.SECONDS);
    }

    /** SIGSTOP: the server stalls, its connections stay open; {@link #resume()} lets it go on. */
    void pause() throws IOException, InterruptedException {
        signal("-STOP");
    }

    /** SIGCONT after {@link #pause()}. */
    void resume() throws IOException, InterruptedException {
        signal("-CONT");
    }

    private void signal(String sig) throws IOException, InterruptedException {
        new ProcessBuilder("kill", sig, String.valueOf(process.pid())).inheritIO().start().waitFor(5, TimeUnit.SECONDS);
    }

    void stop() {
        process.destroy();
        try {
            if (!process.waitFor(5, TimeUnit.SECONDS)) {
                process.destroyForcibly();
            }
        } catch (InterruptedException e) {
            process.destroyForcibly();
        }
        Resp.tls(port, null);
        delete(dir.toFile());
    }

    /** Deletes a file, or a directory with what it holds (an AOF lives in a directory of its own). */
    private static void delete(File f) {
        File[] files = f.listFiles();
        if (files != null) {
            for (File c : files) {
                delete(c);
            }
        }
        f.delete();
    }
}

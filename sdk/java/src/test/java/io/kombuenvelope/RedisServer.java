package io.kombuenvelope;

import java.io.File;
import java.io.IOException;
import java.net.ServerSocket;
import java.net.Socket;
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

    private RedisServer(int fixedPort) throws IOException, InterruptedException {
        dir = Files.createTempDirectory("kombu-envelope-redis");
        String bin = System.getProperty("kombuenvelope.redis.server", "redis-server");
        IOException last = null;
        for (int attempt = 0; attempt < 5; attempt++) {
            int p = fixedPort != 0 ? fixedPort : freePort();
            ProcessBuilder pb = new ProcessBuilder(List.of(bin, "--port", String.valueOf(p), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", dir.toString()))
                    .redirectErrorStream(true).redirectOutput(dir.resolve("redis.log").toFile());
            Process proc = pb.start();
            if (waitForPort(p, proc)) {
                this.port = p;
                this.process = proc;
                Runtime.getRuntime().addShutdownHook(new Thread(this::stopQuietly));
                return;
            }
            proc.destroyForcibly();
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
            try (Socket s = new Socket("127.0.0.1", port)) {
                s.getOutputStream().write("PING\r\n".getBytes());
                byte[] buf = new byte[7];
                int n = s.getInputStream().read(buf);
                if (n > 0 && new String(buf, 0, n).startsWith("+PONG")) {
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

    void stop() {
        process.destroy();
        try {
            if (!process.waitFor(5, TimeUnit.SECONDS)) {
                process.destroyForcibly();
            }
        } catch (InterruptedException e) {
            process.destroyForcibly();
        }
        File[] files = dir.toFile().listFiles();
        if (files != null) {
            for (File f : files) {
                f.delete();
            }
        }
        dir.toFile().delete();
    }
}

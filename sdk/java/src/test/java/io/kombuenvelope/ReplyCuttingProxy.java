package io.kombuenvelope;

import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * A TCP proxy on a free loopback port in front of a test server. While {@linkplain #arm armed},
 * a connection that sends a request containing the marker is forwarded that request, and cut
 * as soon as the server answers, before the reply reaches the client: the command ran, its
 * reply was lost. A client that sends it again after reconnecting is cut again.
 */
final class ReplyCuttingProxy implements AutoCloseable {
    private final ServerSocket listener;
    private final int target;
    private final Set<Socket> open = ConcurrentHashMap.newKeySet();
    private volatile byte[] marker;
    private final AtomicInteger cuts = new AtomicInteger();

    /** A proxy to the server on {@code targetPort}. */
    ReplyCuttingProxy(int targetPort) throws IOException {
        this.target = targetPort;
        this.listener = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
        Thread accept = new Thread(this::accept, "reply-cutting-proxy");
        accept.setDaemon(true);
        accept.start();
    }

    String uri() {
        return "redis://127.0.0.1:" + listener.getLocalPort();
    }

    /** Cuts the replies to requests containing {@code text} from now on. */
    void arm(String text) {
        marker = text.getBytes(StandardCharsets.UTF_8);
    }

    /** Forwards everything again. */
    void disarm() {
        marker = null;
    }

    /** How many replies were cut so far. */
    int cuts() {
        return cuts.get();
    }

    private void accept() {
        while (!listener.isClosed()) {
            try {
                Socket client = listener.accept();
                Socket server = new Socket(InetAddress.getLoopbackAddress(), target);
                open.add(client);
                open.add(server);
                AtomicBoolean cutting = new AtomicBoolean();
                pump(client, server, cutting, true);
                pump(server, client, cutting, false);
            } catch (IOException e) {
                return; // closed
            }
        }
    }

    /** Copies {@code from} to {@code to}: requests mark the connection, replies to a marked one cut it. */
    private void pump(Socket from, Socket to, AtomicBoolean cutting, boolean requests) {
        Thread t = new Thread(() -> {
            byte[] buf = new byte[64 * 1024];
            try (from; to) {
                InputStream in = from.getInputStream();
                OutputStream out = to.getOutputStream();
                for (int n; (n = in.read(buf)) > 0; ) {
                    if (requests) {
                        byte[] m = marker;
                        if (m != null && contains(buf, n, m)) {
                            cutting.set(true);
                        }
                    } else if (cutting.get()) {
                        cuts.incrementAndGet();
                        return; // closes both sockets, the reply unsent
                    }
                    out.write(buf, 0, n);
                    out.flush();
                }
            } catch (IOException e) {
                // the other side closed
            } finally {
                open.remove(from);
                open.remove(to);
            }
        }, "reply-cutting-proxy-pump");
        t.setDaemon(true);
        t.start();
    }

    private static boolean contains(byte[] buf, int n, byte[] m) {
        outer:
        for (int i = 0; i + m.length <= n; i++) {
            for (int j = 0; j < m.length; j++) {
                if (buf[i + j] != m[j]) {
                    continue outer;
                }
            }
            return true;
        }
        return false;
    }

    @Override
    public void close() throws IOException {
        listener.close();
        for (Socket s : open) {
            s.close();
        }
    }
}

package io.kombuenvelope;

import java.io.BufferedInputStream;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.function.Predicate;

/**
 * A TCP proxy on a free loopback port to a test server that loses the reply of one command: the
 * first command {@code losing} picks out that the server runs (answers without an error) reaches
 * the server, but its client gets an error in place of the reply, as when a reply is lost in a
 * failover. Every other command and reply passes through unchanged.
 */
final class ReplyLosingProxy implements AutoCloseable {
    private final ServerSocket listener;
    private final int upstreamPort;
    private final Predicate<List<String>> losing;
    private final AtomicBoolean armed = new AtomicBoolean(true);
    private final CountDownLatch lost = new CountDownLatch(1);
    private final List<Socket> sockets = new CopyOnWriteArrayList<>();

    /** A proxy to the server on {@code upstreamPort} losing the reply of the first {@code losing} command. */
    ReplyLosingProxy(int upstreamPort, Predicate<List<String>> losing) throws IOException {
        this.upstreamPort = upstreamPort;
        this.losing = losing;
        this.listener = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
        daemon(this::accept);
    }

    /** The URI clients connect to. */
    String uri() {
        return "redis://127.0.0.1:" + listener.getLocalPort();
    }

    /** Released once a reply has been lost. */
    CountDownLatch lost() {
        return lost;
    }

    private void accept() {
        try {
            while (true) {
                Socket client = listener.accept();
                Socket server = new Socket(InetAddress.getLoopbackAddress(), upstreamPort);
                sockets.add(client);
                sockets.add(server);
                BlockingQueue<Boolean> toLose = new LinkedBlockingQueue<>();
                daemon(() -> requests(client, server, toLose));
                daemon(() -> replies(server, client, toLose));
            }
        } catch (IOException e) {
            // closed
        }
    }

    /** Forwards each command, noting first whether its reply may be the one to lose. */
    private void requests(Socket client, Socket server, BlockingQueue<Boolean> toLose) {
        try (InputStream in = new BufferedInputStream(client.getInputStream());
             OutputStream out = server.getOutputStream()) {
            while (true) {
                ByteArrayOutputStream raw = new ByteArrayOutputStream();
                List<String> command = command(in, raw);
                toLose.add(armed.get() && losing.test(command));
                out.write(raw.toByteArray());
                out.flush();
            }
        } catch (IOException e) {
            closeQuietly(server);
        }
    }

    /** Forwards each reply, but an error in place of the one to lose. */
    private void replies(Socket server, Socket client, BlockingQueue<Boolean> toLose) {
        try (InputStream in = new BufferedInputStream(server.getInputStream());
             OutputStream out = client.getOutputStream()) {
            while (true) {
                ByteArrayOutputStream raw = new ByteArrayOutputStream();
                copyReply(in, raw);
                byte[] reply = raw.toByteArray();
                boolean lose = toLose.take() && reply[0] != '-' && armed.compareAndSet(true, false);
                out.write(lose ? "-ERR the reply was lost on its way back\r\n".getBytes(StandardCharsets.UTF_8) : reply);
                out.flush();
                if (lose) {
                    lost.countDown();
                }
            }
        } catch (IOException e) {
            closeQuietly(client);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
    }

    /** One command (an array of bulk strings), its bytes copied to {@code raw}. */
    private static List<String> command(InputStream in, ByteArrayOutputStream raw) throws IOException {
        String head = line(in, raw);
        if (!head.startsWith("*")) {
            throw new IOException("not a command: " + head);
        }
        int n = Integer.parseInt(head.substring(1));
        List<String> args = new ArrayList<>(n);
        for (int i = 0; i < n; i++) {
            int len = Integer.parseInt(line(in, raw).substring(1));
            byte[] v = in.readNBytes(len + 2);
            raw.write(v);
            args.add(new String(v, 0, len, StandardCharsets.UTF_8));
        }
        return args;
    }

    /** Copies one RESP2 reply to {@code raw}. */
    private static void copyReply(InputStream in, ByteArrayOutputStream raw) throws IOException {
        String head = line(in, raw);
        int n = head.length() > 1 && (head.charAt(0) == '$' || head.charAt(0) == '*')
                ? Integer.parseInt(head.substring(1)) : -1;
        if (head.charAt(0) == '$' && n >= 0) {
            raw.write(in.readNBytes(n + 2));
        } else if (head.charAt(0) == '*') {
            for (int i = 0; i < n; i++) {
                copyReply(in, raw);
            }
        }
    }

    /** One line without its CRLF, copied with it to {@code raw}. */
    private static String line(InputStream in, ByteArrayOutputStream raw) throws IOException {
        ByteArrayOutputStream b = new ByteArrayOutputStream();
        int c;
        while ((c = in.read()) != '\n') {
            if (c < 0) {
                throw new IOException("connection closed");
            }
            b.write(c);
        }
        byte[] v = b.toByteArray();
        raw.write(v);
        raw.write('\n');
        return new String(v, 0, v.length - 1, StandardCharsets.UTF_8);
    }

    private static void daemon(Runnable r) {
        Thread t = new Thread(r, "reply-losing-proxy");
        t.setDaemon(true);
        t.start();
    }

    private static void closeQuietly(Socket s) {
        try {
            s.close();
        } catch (IOException e) {
            // already closed
        }
    }

    @Override
    public void close() throws IOException {
        listener.close();
        sockets.forEach(ReplyLosingProxy::closeQuietly);
    }
}

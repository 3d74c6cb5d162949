package io.kombuenvelope;

import java.io.BufferedInputStream;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;

import javax.net.ssl.SSLContext;

/** Admin commands to a test server over short-lived sockets (no client library, so it is cheap to poll). */
final class Resp {
    private final int port;
    private final String password;

    private Resp(int port, String password) {
        this.port = port;
        this.password = password;
    }

    /** The server on {@code port}, without a password. */
    static Resp at(int port) {
        return new Resp(port, null);
    }

    /** The server on {@code port}, authenticating with {@code password} (null: none). */
    static Resp at(int port, String password) {
        return new Resp(port, password);
    }

    /** Ports of test servers that speak TLS only, with the context that checks their certificates. */
    private static final Map<Integer, SSLContext> TLS_PORTS = new ConcurrentHashMap<>();

    /** Speak TLS to the server on {@code port} from now on (null: plain TCP again). */
    static void tls(int port, SSLContext context) {
        if (context == null) {
            TLS_PORTS.remove(port);
        } else {
            TLS_PORTS.put(port, context);
        }
    }

    /** The reply: a String, a Long, a List, or null; an error reply is thrown. */
    Object call(String... command) throws IOException {
        try (Socket s = open()) {
            OutputStream out = s.getOutputStream();
            BufferedInputStream in = new BufferedInputStream(s.getInputStream());
            if (password != null) {
                send(out, "AUTH", password);
                read(in);
            }
            send(out, command);
            return read(in);
        }
    }

    /** A connected socket, TLS when the port is one of {@link #TLS_PORTS}. */
    private Socket open() throws IOException {
        Socket plain = new Socket();
        try {
            plain.connect(new InetSocketAddress("127.0.0.1", port), 1000);
            plain.setSoTimeout(5000);
            SSLContext context = TLS_PORTS.get(port);
            return context == null ? plain : context.getSocketFactory().createSocket(plain, "127.0.0.1", port, true);
        } catch (IOException | RuntimeException e) {
            plain.close();
            throw e;
        }
    }

    private static void send(OutputStream out, String... command) throws IOException {
        ByteArrayOutputStream b = new ByteArrayOutputStream();
        b.write(("*" + command.length + "\r\n").getBytes(StandardCharsets.UTF_8));
        for (String c : command) {
            byte[] v = c.getBytes(StandardCharsets.UTF_8);
            b.write(("$" + v.length + "\r\n").getBytes(StandardCharsets.UTF_8));
            b.write(v);
            b.write("\r\n".getBytes(StandardCharsets.UTF_8));
        }
        out.write(b.toByteArray());
        out.flush();
    }

    /** The reply as text, or "" when the server does not answer or answers an error. */
    String text(String... command) {
        try {
            Object r = call(command);
            return r == null ? "" : r.toString();
        } catch (IOException | IllegalStateException e) {
            return "";
        }
    }

    /** A flat name/value array reply (SENTINEL MASTER) as a map; empty when the server does not answer. */
    Map<String, String> pairs(String... command) {
        Map<String, String> out = new LinkedHashMap<>();
        try {
            Object r = call(command);
            if (r instanceof List<?> l) {
                for (int i = 0; i + 1 < l.size(); i += 2) {
                    out.put(String.valueOf(l.get(i)), String.valueOf(l.get(i + 1)));
                }
            }
        } catch (IOException | IllegalStateException e) {
            // not answering
        }
        return out;
    }

    private static Object read(InputStream in) throws IOException {
        int type = in.read();
        String line = line(in);
        switch (type) {
            case '+':
                return line;
            case '-':
                throw new IllegalStateException(line);
            case ':':
                return Long.parseLong(line);
            case '$': {
                int n = Integer.parseInt(line);
                if (n < 0) {
                    return null;
                }
                byte[] v = in.readNBytes(n);
                line(in);
                return new String(v, StandardCharsets.UTF_8);
            }
            case '*': {
                int n = Integer.parseInt(line);
                if (n < 0) {
                    return null;
                }
                List<Object> out = new ArrayList<>(n);
                for (int i = 0; i < n; i++) {
                    out.add(read(in));
                }
                return out;
            }
            default:
                throw new IOException("unexpected reply type " + type);
        }
    }

    private static String line(InputStream in) throws IOException {
        ByteArrayOutputStream b = new ByteArrayOutputStream();
        int c;
        while ((c = in.read()) != '\r') {
            if (c < 0) {
                throw new IOException("connection closed");
            }
            b.write(c);
        }
        in.read();
        return b.toString(StandardCharsets.UTF_8);
    }
}

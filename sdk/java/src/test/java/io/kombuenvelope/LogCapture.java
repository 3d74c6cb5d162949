package io.kombuenvelope;

import java.io.ByteArrayOutputStream;
import java.io.OutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.List;

/** Records what is logged (slf4j-simple writes to System.err) while it is open, still passing it on. */
final class LogCapture implements AutoCloseable {
    private final PrintStream original = System.err;
    private final ByteArrayOutputStream copy = new ByteArrayOutputStream();

    LogCapture() {
        System.setErr(new PrintStream(new OutputStream() {
            @Override
            public synchronized void write(int b) {
                copy.write(b);
                original.write(b);
            }

            @Override
            public synchronized void write(byte[] b, int off, int len) {
                copy.write(b, off, len);
                original.write(b, off, len);
            }
        }, true, StandardCharsets.UTF_8));
    }

    /** The lines logged so far that contain {@code text}. */
    List<String> lines(String text) {
        String all;
        synchronized (copy) {
            all = copy.toString(StandardCharsets.UTF_8);
        }
        return all.lines().filter(l -> l.contains(text)).toList();
    }

    @Override
    public void close() {
        System.setErr(original);
    }
}

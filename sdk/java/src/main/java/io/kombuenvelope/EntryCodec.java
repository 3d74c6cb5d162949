package io.kombuenvelope;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.zip.CRC32;
import java.util.zip.DataFormatException;
import java.util.zip.Deflater;
import java.util.zip.GZIPOutputStream;
import java.util.zip.Inflater;

/** The stream entry encoding (docs/protocol.md section 3): fields {@code v}, {@code enc}, {@code body}. */
public final class EntryCodec {
    public static final String WIRE_VERSION = "1";
    public static final String ENC_JSON = "json";
    public static final String ENC_JSON_GZIP = "json+gzip";
    /** Bodies of at least this many bytes are compressed by default. */
    public static final int GZIP_MIN_BYTES = 8192;

    private EntryCodec() {}

    /** An encoded body and its {@code enc}. */
    public record Body(String enc, byte[] bytes) {}

    /** Encodes with the default compression threshold. */
    public static Body encodeBody(Envelope e, Limits limits) {
        return encodeBody(e, GZIP_MIN_BYTES, limits);
    }

    /**
     * The body of {@code e}, gzip-compressed when its JSON has at least {@code gzipMin} bytes
     * ({@code gzipMin <= 0}: never) and it has no {@code ordering_key}: the scripts read the key
     * from a plain body (docs/protocol.md section 20). An Envelope whose JSON exceeds the body
     * limit is refused, so every entry written can be read back.
     */
    public static Body encodeBody(Envelope e, int gzipMin, Limits limits) {
        byte[] body = e.toJson();
        if (body.length > limits.maxBodyBytes()) {
            throw new EnvelopeValidationException(List.of(new Violation("envelope", "max_bytes",
                    "the Envelope is " + body.length + " bytes of JSON, above the limit of " + limits.maxBodyBytes())));
        }
        if (gzipMin <= 0 || body.length < gzipMin || e.orderingKey() != null) {
            return new Body(ENC_JSON, body);
        }
        ByteArrayOutputStream out = new ByteArrayOutputStream(body.length / 4 + 64);
        try (GZIPOutputStream gz = new GZIPOutputStream(out) {
            {
                def.setLevel(Deflater.DEFAULT_COMPRESSION);
            }
        }) {
            gz.write(body);
        } catch (IOException ex) {
            throw new UncheckedIOException(ex);
        }
        return new Body(ENC_JSON_GZIP, out.toByteArray());
    }

    /** The fields of the stream entry that stores {@code e}, in order. */
    public static Map<String, byte[]> encodeEntry(Envelope e, int gzipMin, Limits limits) {
        Body b = encodeBody(e, gzipMin, limits);
        Map<String, byte[]> fields = new LinkedHashMap<>();
        fields.put("v", bytes(WIRE_VERSION));
        fields.put("enc", bytes(b.enc()));
        fields.put("body", b.bytes());
        return fields;
    }

    /** Decodes entry fields; unknown fields are ignored. */
    public static Envelope decodeEntry(Map<String, byte[]> fields, Limits limits) throws MalformedEntryException {
        byte[] v = fields.get("v");
        if (v == null) {
            throw new MalformedEntryException("missing_field", "missing field 'v'", null);
        }
        if (!Arrays.equals(v, bytes(WIRE_VERSION))) {
            throw new MalformedEntryException("version", "unsupported wire version " + quote(v), null);
        }
        byte[] enc = fields.get("enc");
        if (enc == null) {
            throw new MalformedEntryException("missing_field", "missing field 'enc'", null);
        }
        byte[] body = fields.get("body");
        if (body == null) {
            throw new MalformedEntryException("missing_field", "missing field 'body'", null);
        }
        return decodeBody(new String(enc, StandardCharsets.UTF_8), body, limits);
    }

    /** Decodes a body written with encoding {@code enc}. */
    public static Envelope decodeBody(String enc, byte[] body, Limits limits) throws MalformedEntryException {
        int limit = limits.maxBodyBytes();
        if (ENC_JSON_GZIP.equals(enc)) {
            body = inflate(body, limit);
        } else if (ENC_JSON.equals(enc)) {
            if (body.length > limit) {
                throw new MalformedEntryException("too_large",
                        "body too large: " + body.length + " bytes, above the limit of " + limit, null);
            }
        } else {
            throw new MalformedEntryException("encoding", "unknown encoding " + quote(bytes(enc)), null);
        }
        try {
            return Envelope.parse(body, limits);
        } catch (EnvelopeValidationException e) {
            throw new MalformedEntryException("envelope", e.getMessage(), e.violations());
        }
    }

    /** Inflates exactly one gzip member (RFC 1952) of at most {@code limit} bytes. */
    static byte[] inflate(byte[] in, int limit) throws MalformedEntryException {
        int pos;
        try {
            pos = gzipHeaderEnd(in);
        } catch (IndexOutOfBoundsException e) {
            throw gzip("truncated header");
        }
        Inflater inf = new Inflater(true);
        try {
            inf.setInput(in, pos, in.length - pos);
            ByteArrayOutputStream out = new ByteArrayOutputStream(Math.min(limit, Math.max(64, in.length * 4)) + 1);
            byte[] buf = new byte[64 * 1024];
            long total = 0;
            while (!inf.finished()) {
                int n;
                try {
                    n = inf.inflate(buf);
                } catch (DataFormatException e) {
                    throw gzip("bad deflate data: " + e.getMessage());
                }
                if (n == 0) {
                    if (inf.needsInput()) {
                        throw gzip("truncated");
                    }
                    if (inf.needsDictionary()) {
                        throw gzip("needs a dictionary");
                    }
                }
                total += n;
                if (total > limit) {
                    throw new MalformedEntryException("too_large",
                            "body too large: gzip body inflates beyond " + limit + " bytes", null);
                }
                out.write(buf, 0, n);
            }
            int trailer = in.length - inf.getRemaining();
            if (in.length - trailer < 8) {
                throw gzip("truncated trailer");
            }
            byte[] data = out.toByteArray();
            CRC32 crc = new CRC32();
            crc.update(data);
            long storedCrc = le32(in, trailer);
            long storedSize = le32(in, trailer + 4);
            if (storedCrc != crc.getValue()) {
                throw gzip("bad checksum");
            }
            if (storedSize != (data.length & 0xffffffffL)) {
                throw gzip("bad length");
            }
            if (trailer + 8 != in.length) {
                throw gzip((in.length - trailer - 8) + " bytes after the end of the gzip member");
            }
            return data;
        } finally {
            inf.end();
        }
    }

    private static int gzipHeaderEnd(byte[] in) throws MalformedEntryException {
        if (in.length < 10 || (in[0] & 0xff) != 0x1f || (in[1] & 0xff) != 0x8b) {
            throw gzip("bad header");
        }
        if (in[2] != 8) {
            throw gzip("unknown compression method");
        }
        int flags = in[3] & 0xff;
        if ((flags & 0xe0) != 0) {
            throw gzip("reserved flags set");
        }
        int pos = 10;
        if ((flags & 4) != 0) { // FEXTRA
            int xlen = (in[pos] & 0xff) | (in[pos + 1] & 0xff) << 8;
            pos += 2 + xlen;
        }
        if ((flags & 8) != 0) { // FNAME
            while (in[pos] != 0) {
                pos++;
            }
            pos++;
        }
        if ((flags & 16) != 0) { // FCOMMENT
            while (in[pos] != 0) {
                pos++;
            }
            pos++;
        }
        if ((flags & 2) != 0) { // FHCRC
            pos += 2;
        }
        if (pos > in.length) {
            throw gzip("truncated header");
        }
        return pos;
    }

    private static long le32(byte[] b, int i) {
        return (b[i] & 0xffL) | (b[i + 1] & 0xffL) << 8 | (b[i + 2] & 0xffL) << 16 | (b[i + 3] & 0xffL) << 24;
    }

    private static MalformedEntryException gzip(String why) {
        return new MalformedEntryException("gzip", "body is not valid gzip: " + why, null);
    }

    private static String quote(byte[] b) {
        return "\"" + new String(b, StandardCharsets.UTF_8) + "\"";
    }

    static byte[] bytes(String s) {
        return s.getBytes(StandardCharsets.UTF_8);
    }
}

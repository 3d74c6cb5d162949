package io.kombuenvelope;

import io.lettuce.core.ClientOptions;
import io.lettuce.core.SslOptions;
import io.lettuce.core.SslVerifyMode;

import java.io.File;
import java.util.Map;
import java.util.Set;

/**
 * The TLS options of a Redis URL's query, spelt as redis-py's: {@code ssl_ca_certs} (PEM file of
 * the CAs to trust instead of the JVM's), {@code ssl_certfile} and {@code ssl_keyfile} (PEM client
 * certificate and its unencrypted PKCS#8 key, given together) and {@code ssl_cert_reqs}
 * ({@code required}, the default: the server's certificate must chain to a trusted CA and name the
 * host connected to; {@code none}: not checked). They apply to every connection of the client:
 * data nodes, sentinels, cluster nodes.
 */
final class TlsOptions {
    /** The query options read here. */
    static final Set<String> NAMES = Set.of("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs");

    /** No option given: the JVM's CAs, full verification, no client certificate. */
    static final TlsOptions DEFAULT = new TlsOptions(null, null, null, true);

    /** Reports a wrong option: (part of the URL, why) to the exception to throw. */
    interface Errors {
        IllegalArgumentException bad(String part, String why);
    }

    private final File ca;
    private final File cert;
    private final File key;
    private final boolean verify;

    private TlsOptions(File ca, File cert, File key, boolean verify) {
        this.ca = ca;
        this.cert = cert;
        this.key = key;
        this.verify = verify;
    }

    /**
     * The options among {@code query} (a URL whose scheme asks for TLS when {@code tls}); the
     * files must be readable now, so a wrong path fails at once.
     */
    static TlsOptions of(Map<String, String> query, boolean tls, Errors errors) {
        Map<String, String> given = new java.util.LinkedHashMap<>(query);
        given.keySet().retainAll(NAMES);
        if (given.isEmpty()) {
            return DEFAULT;
        }
        if (!tls) {
            throw errors.bad("query", String.join(", ", given.keySet())
                    + " need TLS: use the rediss scheme (rediss://, rediss-sentinel://, rediss-cluster://)");
        }
        String reqs = given.getOrDefault("ssl_cert_reqs", "required");
        if (!reqs.equals("required") && !reqs.equals("none")) {
            throw errors.bad("query", "ssl_cert_reqs \"" + reqs + "\" is not required or none");
        }
        File cert = file(given, "ssl_certfile", errors);
        File key = file(given, "ssl_keyfile", errors);
        if ((cert == null) != (key == null)) {
            throw errors.bad("query", "ssl_certfile and ssl_keyfile go together (a client certificate and its key)");
        }
        return new TlsOptions(file(given, "ssl_ca_certs", errors), cert, key, reqs.equals("required"));
    }

    private static File file(Map<String, String> given, String name, Errors errors) {
        String path = given.get(name);
        if (path == null) {
            return null;
        }
        File f = new File(path);
        if (!f.isFile() || !f.canRead()) {
            throw errors.bad("query", name + " \"" + path + "\" is not a readable file");
        }
        return f;
    }

    /** How the server's certificate is checked: {@link SslVerifyMode#FULL} (CA and host name) or NONE. */
    SslVerifyMode verifyMode() {
        return verify ? SslVerifyMode.FULL : SslVerifyMode.NONE;
    }

    /** Sets the CA and client certificate on {@code options}, if any were given. */
    <B extends ClientOptions.Builder> B applyTo(B options) {
        if (ca == null && cert == null) {
            return options;
        }
        SslOptions.Builder ssl = SslOptions.builder().jdkSslProvider();
        if (ca != null) {
            ssl.trustManager(ca);
        }
        if (cert != null) {
            ssl.keyManager(cert, key, null);
        }
        options.sslOptions(ssl.build());
        return options;
    }
}

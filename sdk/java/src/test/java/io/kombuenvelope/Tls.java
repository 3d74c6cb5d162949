package io.kombuenvelope;

import java.io.IOException;
import java.io.InputStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.KeyFactory;
import java.security.KeyStore;
import java.security.PrivateKey;
import java.security.cert.Certificate;
import java.security.cert.CertificateFactory;
import java.security.spec.PKCS8EncodedKeySpec;
import java.util.Base64;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

import javax.net.ssl.KeyManagerFactory;
import javax.net.ssl.SSLContext;
import javax.net.ssl.TrustManagerFactory;

/**
 * Throw-away certificates made with {@code openssl}: a CA, a server certificate for 127.0.0.1 and a
 * client certificate it signed, and a second CA that signed neither (the wrong CA). The server
 * certificate is good for clientAuth too: cluster nodes present it to each other on the bus, and
 * the bus always checks it.
 */
final class Tls {
    private static final String CONFIG = String.join("\n",
            "[req]", "distinguished_name = dn", "prompt = no", "[dn]", "CN = placeholder",
            "[ca]", "basicConstraints = critical, CA:TRUE", "keyUsage = critical, keyCertSign, cRLSign",
            "subjectKeyIdentifier = hash",
            "[server]", "basicConstraints = critical, CA:FALSE", "keyUsage = critical, digitalSignature, keyEncipherment",
            "extendedKeyUsage = serverAuth, clientAuth", "subjectAltName = IP:127.0.0.1", "subjectKeyIdentifier = hash",
            "authorityKeyIdentifier = keyid, issuer",
            "[client]", "basicConstraints = critical, CA:FALSE", "keyUsage = critical, digitalSignature",
            "extendedKeyUsage = clientAuth", "subjectKeyIdentifier = hash", "authorityKeyIdentifier = keyid, issuer", "");
    private static final List<String> NEW_KEY = List.of("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes");

    final Path dir;
    final Path ca;
    final Path otherCa;
    final Path serverCert;
    final Path serverKey;
    final Path clientCert;
    final Path clientKey;
    /**
     * Trusts {@link #ca} and presents the client certificate: the test's own admin commands
     * ({@link Resp}) check the servers with it.
     */
    final SSLContext context;

    private Tls(Path dir) throws IOException, InterruptedException {
        this.dir = dir;
        Files.writeString(dir.resolve("openssl.cnf"), CONFIG);
        ca = ca("ca");
        otherCa = ca("other-ca");
        serverCert = signed("server", "127.0.0.1");
        serverKey = dir.resolve("server.key");
        clientCert = signed("client", "kombu-envelope test client");
        clientKey = dir.resolve("client.key");
        context = adminContext();
    }

    /** New certificates in a new temporary directory. */
    static Tls make() throws IOException, InterruptedException {
        return new Tls(Files.createTempDirectory("kombu-envelope-tls"));
    }

    /**
     * The arguments that make a redis-server (or sentinel) speak TLS with the server certificate,
     * replication and the sentinels' links included; client certificates are not asked for
     * ({@code --tls-auth-clients yes} after these asks for them).
     */
    List<String> serverArgs() {
        return List.of("--tls-cert-file", serverCert.toString(), "--tls-key-file", serverKey.toString(),
                "--tls-ca-cert-file", ca.toString(), "--tls-auth-clients", "no",
                "--tls-replication", "yes");
    }

    /** The URL query naming the CA: {@code ssl_ca_certs=<path>}. */
    String caQuery() {
        return "ssl_ca_certs=" + ca;
    }

    private Path ca(String name) throws IOException, InterruptedException {
        List<String> args = new ArrayList<>(List.of("req", "-x509", "-new"));
        args.addAll(NEW_KEY);
        args.addAll(List.of("-config", "openssl.cnf", "-extensions", "ca", "-subj", "/CN=kombu-envelope " + name,
                "-days", "2", "-keyout", name + ".key", "-out", name + ".crt"));
        openssl(args);
        return dir.resolve(name + ".crt");
    }

    private Path signed(String name, String commonName) throws IOException, InterruptedException {
        List<String> args = new ArrayList<>(List.of("req", "-new"));
        args.addAll(NEW_KEY);
        args.addAll(List.of("-config", "openssl.cnf", "-subj", "/CN=" + commonName, "-keyout", name + ".key",
                "-out", name + ".csr"));
        openssl(args);
        openssl(List.of("x509", "-req", "-in", name + ".csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-set_serial", String.valueOf(System.nanoTime()), "-days", "2", "-extfile", "openssl.cnf",
                "-extensions", name, "-out", name + ".crt"));
        return dir.resolve(name + ".crt");
    }

    private void openssl(List<String> args) throws IOException, InterruptedException {
        List<String> cmd = new ArrayList<>(List.of("openssl"));
        cmd.addAll(args);
        Process p = new ProcessBuilder(cmd).directory(dir.toFile()).redirectErrorStream(true).start();
        String out = new String(p.getInputStream().readAllBytes());
        if (!p.waitFor(60, TimeUnit.SECONDS) || p.exitValue() != 0) {
            throw new IOException(String.join(" ", cmd) + " failed: " + out);
        }
    }

    private SSLContext adminContext() throws IOException {
        try (InputStream in = Files.newInputStream(ca); InputStream client = Files.newInputStream(clientCert)) {
            CertificateFactory x509 = CertificateFactory.getInstance("X.509");
            KeyStore trust = KeyStore.getInstance(KeyStore.getDefaultType());
            trust.load(null, null);
            trust.setCertificateEntry("ca", x509.generateCertificate(in));
            TrustManagerFactory tmf = TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
            tmf.init(trust);
            String pem = Files.readString(clientKey).replaceAll("-----[A-Z ]+-----", "").replaceAll("\\s", "");
            PrivateKey key = KeyFactory.getInstance("EC").generatePrivate(
                    new PKCS8EncodedKeySpec(Base64.getDecoder().decode(pem)));
            KeyStore keys = KeyStore.getInstance(KeyStore.getDefaultType());
            keys.load(null, null);
            keys.setKeyEntry("client", key, new char[0], new Certificate[] {x509.generateCertificate(client)});
            KeyManagerFactory kmf = KeyManagerFactory.getInstance(KeyManagerFactory.getDefaultAlgorithm());
            kmf.init(keys, new char[0]);
            SSLContext context = SSLContext.getInstance("TLS");
            context.init(kmf.getKeyManagers(), tmf.getTrustManagers(), null);
            return context;
        } catch (java.security.GeneralSecurityException e) {
            throw new IOException("cannot load the certificates of " + dir, e);
        }
    }
}

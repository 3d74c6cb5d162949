package envelope

// Throw-away certificates for the TLS tests, made with crypto/x509: a CA, a
// certificate for 127.0.0.1 it signed (the servers'), a client certificate it
// signed, and a second CA that signed nothing of the servers'.

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// certificates are the PEM files of one test.
type certificates struct {
	ca, serverCert, serverKey, clientCert, clientKey, otherCA string
	pool                                                      *x509.CertPool // ca
	client                                                    tls.Certificate
}

// makeCertificates writes a new set of certificates into a directory of the test.
func makeCertificates(t *testing.T) *certificates {
	t.Helper()
	dir := t.TempDir()
	c := &certificates{
		ca: filepath.Join(dir, "ca.crt"), serverCert: filepath.Join(dir, "server.crt"),
		serverKey: filepath.Join(dir, "server.key"), clientCert: filepath.Join(dir, "client.crt"),
		clientKey: filepath.Join(dir, "client.key"), otherCA: filepath.Join(dir, "other-ca.crt"),
		pool: x509.NewCertPool(),
	}
	caTemplate := &x509.Certificate{Subject: pkix.Name{CommonName: "kombu-envelope test CA"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign}
	caCert, caKey := writeCertificate(t, caTemplate, nil, nil, c.ca, "")
	c.pool.AddCert(caCert)
	writeCertificate(t, &x509.Certificate{Subject: pkix.Name{CommonName: "127.0.0.1"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}, KeyUsage: x509.KeyUsageDigitalSignature,
		// servers also present it to each other (replication, cluster bus)
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}, caCert, caKey, c.serverCert, c.serverKey)
	writeCertificate(t, &x509.Certificate{Subject: pkix.Name{CommonName: "envelope client"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, caCert, caKey, c.clientCert, c.clientKey)
	var err error
	if c.client, err = tls.LoadX509KeyPair(c.clientCert, c.clientKey); err != nil {
		t.Fatal(err)
	}
	writeCertificate(t, &x509.Certificate{Subject: pkix.Name{CommonName: "another CA"}, IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}, nil, nil, c.otherCA, "")
	return c
}

// writeCertificate signs template with parent's key (itself when parent is
// nil) and writes the certificate, and its key when keyFile is not "".
func writeCertificate(t *testing.T, template, parent *x509.Certificate, parentKey *ecdsa.PrivateKey,
	certFile, keyFile string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		t.Fatal(err)
	}
	template.SerialNumber = serial
	template.NotBefore, template.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(48*time.Hour)
	if parent == nil {
		parent, parentKey = template, key
	}
	der, err := x509.CreateCertificate(rand.Reader, template, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, certFile, "CERTIFICATE", der)
	if keyFile != "" {
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		writePEM(t, keyFile, "PRIVATE KEY", keyDER)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func writePEM(t *testing.T, file, kind string, der []byte) {
	t.Helper()
	if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// serverArgs make a redis-server speak TLS only, on port, with the server
// certificate; client certificates are not asked for (tls-auth-clients no).
func (c *certificates) serverArgs(port int) []string {
	return []string{"--port", "0", "--tls-port", fmt.Sprint(port), "--tls-cert-file", c.serverCert,
		"--tls-key-file", c.serverKey, "--tls-ca-cert-file", c.ca, "--tls-auth-clients", "no"}
}

// clientConfig is the TLS of the tests' own clients: the test CA, checked,
// and the client certificate (for servers with tls-auth-clients yes).
func (c *certificates) clientConfig() *tls.Config {
	return &tls.Config{RootCAs: c.pool, Certificates: []tls.Certificate{c.client}, MinVersion: tls.VersionTLS12}
}

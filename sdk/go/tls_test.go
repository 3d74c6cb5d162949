package envelope

// TLS against real redis-servers that speak TLS only (their plain port is
// closed, so every connection that works is a TLS one): one server, a
// Sentinel group whose sentinels speak TLS too, and a Cluster.

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"
)

// withQuery adds query parameters (name, value, name, value...) to a connection URL.
func withQuery(base string, params ...string) string {
	q := url.Values{}
	for i := 0; i+1 < len(params); i += 2 {
		q.Set(params[i], params[i+1])
	}
	if strings.Contains(base, "?") {
		return base + "&" + q.Encode()
	}
	return base + "?" + q.Encode()
}

func TestAProducerAndAWorkerOverTLSWithTheCAOfTheURL(t *testing.T) {
	certs := makeCertificates(t)
	srv := startTLSNode(t, certs, "")
	h := newHAEnv(t, withQuery("rediss://"+srv.addr()+"/0", "ssl_ca_certs", certs.ca))
	stop := h.runWorkers([]string{"tls"}, Durability{})
	h.roundTrip("tls")
	if exited := stop(); exited != 0 {
		t.Fatalf("%d of the worker and promoter stopped on their own", exited)
	}
}

// A server certificate that the trusted CAs did not sign stops the client at
// once, with an error that says so: no retry, no hang.
func TestAnUntrustedServerCertificateFailsAtOnce(t *testing.T) {
	certs := makeCertificates(t)
	srv := startTLSNode(t, certs, "")
	for name, rawURL := range map[string]string{
		"another CA":           withQuery("rediss://"+srv.addr(), "ssl_ca_certs", certs.otherCA),
		"no CA (the system's)": "rediss://" + srv.addr(),
		"Cluster scheme":       withQuery("rediss-cluster://"+srv.addr(), "ssl_ca_certs", certs.otherCA),
	} {
		client, err := NewUniversalClient(rawURL)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		began := time.Now()
		_, pubErr := NewProducer(client, "tls", DefaultScripts()).PublishTask(ctx, "tls", "tls.none", nil)
		w, err := NewWorker(client, DefaultScripts(), Config{Prefix: "tls", Queue: "tls", Lease: 1500 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		runErr := w.Run(ctx)
		took := time.Since(began)
		cancel()
		client.Close()
		for what, err := range map[string]error{"publish": pubErr, "worker": runErr} {
			if err == nil || errors.Is(err, context.DeadlineExceeded) || IsOutage(err) ||
				!strings.Contains(err.Error(), "certificate") {
				t.Errorf("%s: %s: %v, want a certificate error that is no outage", name, what, err)
			}
		}
		t.Logf("%s: failed in %s: %v", name, took, runErr)
		if took > 3*time.Second {
			t.Errorf("%s: failing took %s", name, took)
		}
	}
}

func TestSkippingVerificationIsOptIn(t *testing.T) {
	certs := makeCertificates(t)
	srv := startTLSNode(t, certs, "")
	for rawURL, verifies := range map[string]bool{
		"rediss://" + srv.addr(): true,
		withQuery("rediss://"+srv.addr(), "ssl_cert_reqs", "required"): true,
		withQuery("rediss://"+srv.addr(), "ssl_cert_reqs", "none"):     false,
	} {
		client, err := NewUniversalClient(rawURL)
		if err != nil {
			t.Fatal(err)
		}
		err = client.Ping(context.Background()).Err()
		client.Close()
		if verifies != (err != nil) {
			t.Errorf("%s: PING with a certificate of an unknown CA: %v", rawURL, err)
		}
	}
}

func TestAClientCertificateForAServerThatAsksForOne(t *testing.T) {
	certs := makeCertificates(t)
	srv := startTLSNode(t, certs, "", "--tls-auth-clients", "yes")
	base := withQuery("rediss://"+srv.addr(), "ssl_ca_certs", certs.ca)
	client, err := NewClient(withQuery(base, "ssl_certfile", certs.clientCert, "ssl_keyfile", certs.clientKey))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if err := client.Ping(context.Background()).Err(); err != nil {
		t.Fatalf("with the client certificate: %v", err)
	}
	without, err := NewClient(base)
	if err != nil {
		t.Fatal(err)
	}
	defer without.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w, err := NewWorker(without, DefaultScripts(), Config{Prefix: "tls", Queue: "tls", Lease: 1500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Run(ctx); err == nil || IsOutage(err) || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("a worker without the client certificate the server asks for: %v, want a TLS error", err)
	}
}

func TestTLSParametersThatCannotBeUsedNameThemselves(t *testing.T) {
	certs := makeCertificates(t)
	for rawURL, part := range map[string]string{
		withQuery("redis://h1", "ssl_ca_certs", certs.ca):                                          "ssl_ca_certs",
		withQuery("redis-sentinel://h1#m", "ssl_cert_reqs", "none"):                                "ssl_cert_reqs",
		withQuery("rediss://h1", "ssl_ca_certs", certs.ca+".missing"):                              "ssl_ca_certs",
		withQuery("rediss-cluster://h1", "ssl_ca_certs", certs.serverKey):                          "ssl_ca_certs",
		withQuery("rediss://h1", "ssl_cert_reqs", "optional"):                                      "ssl_cert_reqs",
		withQuery("rediss://h1", "ssl_certfile", certs.clientCert):                                 "ssl_keyfile",
		withQuery("rediss-sentinel://h1#m", "ssl_keyfile", certs.clientKey):                        "ssl_certfile",
		withQuery("rediss://h1", "ssl_certfile", certs.clientCert, "ssl_keyfile", certs.serverKey): "ssl_certfile",
	} {
		_, err := NewUniversalClient(rawURL)
		var ue *URLError
		if !errors.As(err, &ue) || ue.Part != part {
			t.Errorf("%s: %v, want a URLError naming %s", rawURL, err, part)
		}
	}
}

func TestSentinelOverTLSWithASentinelPassword(t *testing.T) {
	certs := makeCertificates(t)
	g := startSentinelGroupWith(t, groupSetup{replicas: 1, certs: certs, sentinelPassword: "watch-pw"})
	h := newHAEnv(t, withQuery(g.url(), "ssl_ca_certs", certs.ca, "sentinel_password", "watch-pw"))
	stop := h.runWorkers([]string{"tls"}, Durability{})
	h.roundTrip("tls")
	if exited := stop(); exited != 0 {
		t.Fatalf("%d of the worker and promoter stopped on their own", exited)
	}
	for rawURL, want := range map[string]string{ // the sentinels check both
		withQuery(g.url(), "ssl_ca_certs", certs.otherCA, "sentinel_password", "watch-pw"): "certificate",
		withQuery(g.url(), "ssl_ca_certs", certs.ca):                                       "NOAUTH",
	} {
		client, err := NewUniversalClient(rawURL)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = client.Ping(ctx).Err()
		cancel()
		client.Close()
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error saying %s", rawURL, err, want)
		}
		if want == "certificate" && IsOutage(err) {
			t.Errorf("%v: a certificate the sentinels present is checked once, not waited out", err)
		}
	}
}

func TestClusterOverTLS(t *testing.T) {
	certs := makeCertificates(t)
	c := startClusterWith(t, 0, certs)
	h := newHAEnv(t, withQuery(c.url(), "ssl_ca_certs", certs.ca))
	stop := h.runWorkers([]string{"tls"}, Durability{})
	h.roundTrip("tls")
	if exited := stop(); exited != 0 {
		t.Fatalf("%d of the worker and promoter stopped on their own", exited)
	}
}

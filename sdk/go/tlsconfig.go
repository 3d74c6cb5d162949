package envelope

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net/url"
	"os"
)

// The TLS query parameters of a connection URL (the names redis-py takes):
//
//	ssl_ca_certs=<file>   PEM file of the CAs that sign the servers' certificates
//	                      (default: the system's CAs)
//	ssl_certfile=<file>   PEM client certificate, for servers with tls-auth-clients
//	ssl_keyfile=<file>    its private key (required with ssl_certfile)
//	ssl_cert_reqs=none    accept any server certificate (default: required)
var tlsParamNames = []string{"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"}

// takeTLSParams removes the TLS parameters from query and builds the
// tls.Config they describe: nil when the scheme is not a TLS one, an error
// naming the parameter when one is wrong or given without TLS.
func takeTLSParams(raw string, query url.Values, useTLS bool) (*tls.Config, error) {
	given := map[string]string{}
	for _, name := range tlsParamNames {
		if query.Has(name) {
			given[name] = query.Get(name)
			query.Del(name)
		}
	}
	if !useTLS {
		for _, name := range tlsParamNames {
			if _, ok := given[name]; ok {
				return nil, &URLError{raw, name, "needs a TLS scheme (rediss://, rediss-sentinel://, rediss-cluster://)"}
			}
		}
		return nil, nil
	}
	config := &tls.Config{MinVersion: tls.VersionTLS12}
	switch reqs := given["ssl_cert_reqs"]; reqs {
	case "", "required":
	case "none":
		config.InsecureSkipVerify = true
	default:
		return nil, &URLError{raw, "ssl_cert_reqs", fmt.Sprintf("%q is not required or none", reqs)}
	}
	if file := given["ssl_ca_certs"]; file != "" {
		pem, err := os.ReadFile(file)
		if err != nil {
			return nil, &URLError{raw, "ssl_ca_certs", err.Error()}
		}
		config.RootCAs = x509.NewCertPool()
		if !config.RootCAs.AppendCertsFromPEM(pem) {
			return nil, &URLError{raw, "ssl_ca_certs", fmt.Sprintf("%s holds no PEM certificate", file)}
		}
	}
	certFile, keyFile := given["ssl_certfile"], given["ssl_keyfile"]
	switch {
	case certFile == "" && keyFile != "":
		return nil, &URLError{raw, "ssl_certfile", "required with ssl_keyfile"}
	case certFile != "" && keyFile == "":
		return nil, &URLError{raw, "ssl_keyfile", "required with ssl_certfile"}
	case certFile != "":
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, &URLError{raw, "ssl_certfile", err.Error()}
		}
		config.Certificates = []tls.Certificate{pair}
	}
	return config, nil
}

package envelope

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
)

func TestOutagesAreTheErrorsOfANodeThatIsAwayOrBetweenRoles(t *testing.T) {
	outages := []error{
		errors.New("READONLY You can't write against a read only replica."),
		errors.New("MOVED 3999 127.0.0.1:6381"),
		errors.New("ASK 3999 127.0.0.1:6381"),
		errors.New("TRYAGAIN Multiple keys request during rehashing of slot"),
		errors.New("CLUSTERDOWN The cluster is down"),
		errors.New("LOADING Redis is loading the dataset in memory"),
		errors.New("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
		errors.New("UNBLOCKED client unblocked via CLIENT UNBLOCK"),
		io.EOF,
		fmt.Errorf("reading: %w", syscall.ECONNRESET),
		syscall.ECONNREFUSED,
		errors.New("redis: all sentinels specified in configuration are unreachable"),
		// sentinels that disagree, one of them too slow to answer
		&SentinelMajorityError{MasterName: "m", Needed: 2, Listed: 2, Named: []SentinelAnswer{
			{Sentinel: "h1:26379", Primary: "h3:6379"}, {Sentinel: "h2:26379", Err: context.DeadlineExceeded}}},
	}
	for _, err := range outages {
		if !IsOutage(err) {
			t.Errorf("%v is an outage", err)
		}
	}
	for _, err := range []error{
		nil,
		errors.New("ERR Error running script: bad argument"),
		errors.New("NOSCRIPT No matching script"),
		errors.New("WRONGTYPE Operation against a key holding the wrong kind of value"),
		errors.New("READONLYISH not a reply prefix"),
		errors.New("NOAUTH Authentication required."),
		errors.New("WRONGPASS invalid username-password pair or user is disabled."),
		errors.New("redis: all sentinels specified in configuration are unreachable: NOAUTH HELLO must be called with the client already authenticated"),
		context.Canceled,
		fmt.Errorf("publish: %w", context.DeadlineExceeded),
		// TLS handshakes that cannot succeed, even when every sentinel answered with one
		fmt.Errorf("redis: all sentinels specified in configuration are unreachable: %w",
			errors.Join(&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, syscall.ECONNREFUSED)),
		&net.OpError{Op: "remote error", Net: "tcp", Err: errors.New("tls: certificate required")},
		tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"},
		&SentinelMajorityError{MasterName: "m", Needed: 1, Listed: 1, Named: []SentinelAnswer{
			{Sentinel: "h1:26379", Err: &tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}}}},
		&SentinelMajorityError{MasterName: "m", Needed: 1, Listed: 1, Named: []SentinelAnswer{
			{Sentinel: "h1:26379", Err: errors.New("NOAUTH Authentication required.")}}},
	} {
		if IsOutage(err) {
			t.Errorf("%v is not an outage", err)
		}
	}
}

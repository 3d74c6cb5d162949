package envelope

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// outagePrefixes are the replies of a node that is away, between roles or no
// longer the primary of the keys (docs/protocol.md section 5, "Failover").
var outagePrefixes = []string{"READONLY", "MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING",
	"MASTERDOWN", "UNBLOCKED", "NOREPLICAS"}

// IsOutage reports whether err means Redis is unreachable or failing over
// (a reset or refused connection, READONLY, MOVED, ASK, TRYAGAIN, CLUSTERDOWN,
// LOADING, MASTERDOWN, UNBLOCKED, sentinels that name no primary by a
// majority): the step may be retried, and it never counts against a task. A
// TLS handshake that fails (see tlsRefused) is no outage, even when every
// sentinel answered with it.
func IsOutage(err error) bool {
	if err == nil || tlsRefused(err) || passwordRefused(err) {
		return false
	}
	if errors.As(err, new(*SentinelMajorityError)) { // whatever became of the sentinels it asked
		return true
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var netErr net.Error
	if errors.As(err, &netErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed) {
		return true
	}
	msg := err.Error()
	for _, prefix := range outagePrefixes {
		if strings.HasPrefix(msg, prefix+" ") || msg == prefix {
			return true
		}
	}
	return strings.Contains(msg, "connection pool timeout") || strings.Contains(msg, "all sentinels") ||
		strings.Contains(msg, "connection reset")
}

// tlsRefused reports whether err is a TLS handshake that trying again cannot
// mend: a server certificate that fails verification, a TLS alert of the
// server (a client certificate it requires or refuses), or a server that does
// not speak TLS.
func tlsRefused(err error) bool {
	var verification *tls.CertificateVerificationError
	var notTLS tls.RecordHeaderError
	var opErr *net.OpError
	return errors.As(err, &verification) || errors.As(err, &notTLS) ||
		(errors.As(err, &opErr) && opErr.Op == "remote error")
}

// passwordRefused reports whether err is a refused password (NOAUTH or
// WRONGPASS), also inside go-redis' "all sentinels ... unreachable" error:
// waiting cannot cure it (docs/protocol.md, section 5).
func passwordRefused(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "NOAUTH") || strings.Contains(msg, "WRONGPASS")
}

// outageAttempts bound retryOutage: about 15 s of backoff, longer than a
// Sentinel or Cluster failover takes with sensible timeouts.
const outageAttempts = 10

// retryOutage runs step on client, retrying while it fails and retry(err)
// holds, for about 15 s (Redis away, loading or failing over); it returns the
// last error. It stops early when ctx ends.
func retryOutage(ctx context.Context, client redis.UniversalClient, log *slog.Logger, what string,
	retry func(error) bool, step func() error) error {
	delay := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := step()
		if err == nil || attempt == outageAttempts || !retry(err) || ctx.Err() != nil {
			return err
		}
		log.Warn("step failed; retrying", "step", what, "error", err.Error())
		refreshRoutes(ctx, client, err)
		sleep(ctx, delay)
		delay = min(2*delay, 3*time.Second)
	}
}

// refreshRoutes makes a cluster client look the slot map up again after an
// outage error: a node that died is never asked again otherwise (its slots'
// new primary answers no MOVED to a client that keeps dialling the old one).
// Sentinel clients follow the sentinels' announcements themselves.
func refreshRoutes(ctx context.Context, client redis.UniversalClient, err error) {
	if cluster, ok := client.(*redis.ClusterClient); ok && IsOutage(err) {
		cluster.ReloadState(ctx)
	}
}

// anyError retries every error (steps that are safe to repeat whatever failed).
func anyError(error) bool { return true }

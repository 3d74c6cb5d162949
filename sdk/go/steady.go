package envelope

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// errWaited stops a takeover: one of its commands, or the renewal before it,
// waited for Redis (docs/protocol.md section 5, "Never take over entries right
// after Redis was unreachable").
var errWaited = errors.New("a command waited for Redis (retried, reconnected or answered late): its liveness checks are not trusted")

// steadyWatch tells whether commands were answered at once: a command waited
// for Redis when the client dialled a connection meanwhile (go-redis retries a
// failed command on a new connection, and dials while it reconnects) or when
// it took longer than one renewal interval (it queued for a pooled connection,
// or the process stalled).
type steadyWatch struct {
	dials    atomic.Uint64
	interval time.Duration
}

// watchClient counts the dials of client (of each node client on a Cluster).
func watchClient(client redis.UniversalClient, interval time.Duration) *steadyWatch {
	s := &steadyWatch{interval: interval}
	if cluster, ok := client.(*redis.ClusterClient); ok {
		cluster.OnNewNode(func(node *redis.Client) { node.AddHook(s) })
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = cluster.ForEachShard(ctx, func(_ context.Context, node *redis.Client) error {
			node.AddHook(s)
			return nil
		})
		return s
	}
	client.AddHook(s)
	return s
}

// DialHook counts every dial, failed or not.
func (s *steadyWatch) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		s.dials.Add(1)
		return next(ctx, network, addr)
	}
}

// ProcessHook leaves commands alone.
func (s *steadyWatch) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

// ProcessPipelineHook leaves pipelines alone.
func (s *steadyWatch) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// steadySince is a stretch of commands that must all be answered at once.
type steadySince struct {
	watch *steadyWatch
	dials uint64
}

// begin starts a stretch.
func (s *steadyWatch) begin() steadySince { return steadySince{s, s.dials.Load()} }

// check runs one command of the stretch: its error, else errWaited when it took
// longer than a renewal interval or a connection was dialled since the stretch
// began. The zero stretch checks nothing.
func (st steadySince) check(cmd func() error) error {
	start := time.Now()
	if err := cmd(); err != nil || st.watch == nil {
		return err
	}
	if time.Since(start) > st.watch.interval || st.watch.dials.Load() != st.dials {
		return errWaited
	}
	return nil
}

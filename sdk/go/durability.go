package envelope

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"
)

// Durability makes a publish or a settled entry wait for replicas (WAIT) on
// the node that took the write. Redis replicates asynchronously: a write the
// primary acknowledged and lost in a failover before a replica copied it is
// gone. Waiting narrows that window at the price of one round trip to the
// replicas per write (docs/operations.md).
type Durability struct {
	Replicas int           // replicas each write must reach; 0 does not wait
	Timeout  time.Duration // longest wait per write (1 s when zero)
}

func (d Durability) timeout() time.Duration {
	if d.Timeout <= 0 {
		return time.Second
	}
	return d.Timeout
}

// write runs step on client and, with Replicas > 0, then sends WAIT on the
// same connection (WAIT counts the replicas that have this connection's
// writes). key is a key step writes: a cluster client's node is the primary
// of its slot. A WAIT that answers fewer replicas is logged and the write
// stands; a WAIT that fails (the node went away) fails the step, which is
// then retried as a whole (every step given here is safe to repeat).
func (d Durability) write(ctx context.Context, client redis.UniversalClient, key string, log *slog.Logger,
	step func(c redis.Cmdable) error) error {
	if d.Replicas <= 0 {
		return step(client)
	}
	node, err := primaryFor(ctx, client, key)
	if err != nil {
		return err
	}
	conn := node.Conn()
	defer conn.Close()
	err = step(conn)
	if err == nil {
		var got int64
		if got, err = conn.Wait(ctx, d.Replicas, d.timeout()).Result(); err == nil && got < int64(d.Replicas) {
			log.Warn("fewer replicas than asked have the write; it stands", "key", key,
				"replicas", got, "wait_replicas", d.Replicas, "timeout_ms", d.timeout().Milliseconds())
		}
	}
	return err
}

// check refuses a client whose writes cannot be followed by a WAIT on the
// same connection.
func (d Durability) check(client redis.UniversalClient) error {
	if d.Replicas <= 0 {
		return nil
	}
	switch client.(type) {
	case *redis.Client, *redis.ClusterClient:
		return nil
	}
	return fmt.Errorf("durability: waiting for replicas needs a *redis.Client (plain or Sentinel) or a "+
		"*redis.ClusterClient, not %T", client)
}

// primaryFor is the client of the primary that holds key: the client itself,
// or for a cluster client the node serving key's slot.
func primaryFor(ctx context.Context, client redis.UniversalClient, key string) (*redis.Client, error) {
	switch c := client.(type) {
	case *redis.Client:
		return c, nil
	case *redis.ClusterClient:
		return c.MasterForKey(ctx, key)
	}
	return nil, Durability{Replicas: 1}.check(client)
}

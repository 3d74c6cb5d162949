package envelope

// The primary of a Sentinel client is the one a majority of the listed
// sentinels name: two plain primaries X and Y, sentinel A watching X and
// sentinels B and C watching Y, all under one master name.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const splitName = "m"

// startLoneSentinel runs a sentinel that monitors primary as splitName with
// quorum 1, and waits until it names it as a master.
func startLoneSentinel(t *testing.T, primary *redisServer) *redisServer {
	s := startNode(t, fmt.Sprintf("sentinel monitor %s 127.0.0.1 %d 1\n", splitName, primary.port), "--sentinel")
	c := nodeClient(t, s)
	eventually(t, 5*time.Second, "the sentinel to watch its primary", func() bool {
		state, err := redis.NewSentinelClient(s.options()).Master(context.Background(), splitName).Result()
		return err == nil && state["port"] == fmt.Sprint(primary.port) && c.Ping(context.Background()).Err() == nil
	})
	return s
}

// sentinelURL lists sentinels in this order.
func sentinelURL(sentinels ...*redisServer) string {
	addrs := make([]string, len(sentinels))
	for i, s := range sentinels {
		addrs[i] = s.addr()
	}
	return "redis-sentinel://" + strings.Join(addrs, ",") + "/0#" + splitName
}

// keyCount is the number of keys of a node's database 0.
func keyCount(t *testing.T, c *redis.Client) int64 {
	n, err := c.DBSize(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func TestASentinelClientWritesToThePrimaryAMajorityNames(t *testing.T) {
	x, y := startNode(t, ""), startNode(t, "")
	a, b, c := startLoneSentinel(t, x), startLoneSentinel(t, y), startLoneSentinel(t, y)
	cx, cy := nodeClient(t, x), nodeClient(t, y)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// go-redis asks the sentinels in a random order: several clients, so that
	// some of them hear A first.
	var p *Producer
	for range 6 {
		client, err := NewUniversalClient(sentinelURL(a, b, c))
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		p = NewProducer(client, "maj", DefaultScripts())
		if _, err := p.PublishTask(ctx, "q", "t", nil); err != nil {
			t.Fatal(err)
		}
		if nx, ny := keyCount(t, cx), keyCount(t, cy); nx != 0 || ny == 0 {
			t.Fatalf("keys on X %d, on Y %d: the publish must land on Y only", nx, ny)
		}
	}

	// Even when go-redis dials the primary of sentinel A, the hook connects to Y.
	hook := newMajorityPrimary(&multiHostURL{masterName: splitName, addrs: []string{a.addr(), b.addr(), c.addr()}})
	viaA := func(ctx context.Context, network, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, x.addr())
	}
	conn, err := hook.DialHook(viaA)(ctx, "tcp", x.addr())
	if err != nil {
		t.Fatal(err)
	}
	conn.Close()
	if got := conn.RemoteAddr().String(); got != y.addr() {
		t.Fatalf("the hook connected to %s, want Y %s", got, y.addr())
	}

	// A new connection asks again: B now watches X, so A and B name X.
	sb := redis.NewSentinelClient(b.options())
	defer sb.Close()
	if err := sb.Remove(ctx, splitName).Err(); err != nil {
		t.Fatal(err)
	}
	if err := sb.Monitor(ctx, splitName, "127.0.0.1", fmt.Sprint(x.port), "1").Err(); err != nil {
		t.Fatal(err)
	}
	if err := cy.ClientKillByFilter(ctx, "TYPE", "normal", "SKIPME", "yes").Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.PublishTask(ctx, "q", "t", nil); err != nil {
		t.Fatal(err)
	}
	if nx := keyCount(t, cx); nx == 0 {
		t.Fatal("after the reconnection the publish did not land on X, the primary A and B now name")
	}
}

func TestASentinelClientWithoutAMajorityConnectsNowhere(t *testing.T) {
	x, y := startNode(t, ""), startNode(t, "")
	a, b := startLoneSentinel(t, x), startLoneSentinel(t, y)
	client, err := NewUniversalClient(sentinelURL(a, b, b)) // b listed twice still votes once
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()

	err = client.Ping(ctx).Err()
	var disputed *SentinelMajorityError
	if !errors.As(err, &disputed) || !IsOutage(err) {
		t.Fatalf("ping: %v, want a *SentinelMajorityError that is an outage", err)
	}
	for _, want := range []string{`master_name "m": 2 of the 2 listed sentinels must name the same primary`,
		a.addr() + " names " + x.addr(), b.addr() + " names " + y.addr()} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not say %q", err, want)
		}
	}

	logs := &lockedBuffer{}
	p := NewProducer(client, "maj", DefaultScripts())
	p.Log = slog.New(slog.NewJSONHandler(logs, nil))
	publishCtx, cancelPublish := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancelPublish()
	if _, err := p.PublishTask(publishCtx, "q", "t", nil); err == nil {
		t.Fatal("a publish without a majority succeeded")
	}
	if out := logs.String(); !strings.Contains(out, "failed; retrying") || !strings.Contains(out, "sentinel majority") {
		t.Errorf("the publish was not retried as an outage naming the majority rule:\n%s", out)
	}
	if nx, ny := keyCount(t, nodeClient(t, x)), keyCount(t, nodeClient(t, y)); nx != 0 || ny != 0 {
		t.Fatalf("keys on X %d, on Y %d: nothing may be written without a majority", nx, ny)
	}
}

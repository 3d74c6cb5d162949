package envelope

import (
	"bytes"
	"context"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// replyDropper is a TCP proxy to Redis that forwards every command but, on a
// connection that sent one containing marker, drops the reply and closes the
// connection: the command ran, its caller sees a lost reply.
type replyDropper struct {
	l      net.Listener
	target string
	marker []byte
	wg     sync.WaitGroup
}

func startReplyDropper(t *testing.T, target string, marker []byte) *replyDropper {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &replyDropper{l: l, target: target, marker: marker}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() { l.Close(); p.wg.Wait() })
	return p
}

func (p *replyDropper) addr() string { return p.l.Addr().String() }

func (p *replyDropper) accept() {
	defer p.wg.Done()
	for {
		client, err := p.l.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			client.Close()
			continue
		}
		p.wg.Add(2)
		go p.serve(client, server)
	}
}

// serve copies one connection both ways until either side closes.
func (p *replyDropper) serve(client, server net.Conn) {
	var dropping atomic.Bool
	closeBoth := func() { client.Close(); server.Close() }
	go func() { // commands: set dropping before the marked one reaches Redis
		defer p.wg.Done()
		defer closeBoth()
		buf := make([]byte, 64<<10)
		for {
			n, err := client.Read(buf)
			if n > 0 {
				if bytes.Contains(buf[:n], p.marker) {
					dropping.Store(true)
				}
				if _, werr := server.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	defer p.wg.Done()
	defer closeBoth()
	buf := make([]byte, 64<<10)
	for {
		n, err := server.Read(buf)
		if dropping.Load() {
			return // the marked command's reply is lost
		}
		if n > 0 {
			if _, werr := client.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func TestAClaimWhoseReplyWasLostIsReleasedBeforeTheTaskIsHandedBack(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	opts, err := redis.ParseURL(testRedisURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := startReplyDropper(t, opts.Addr, []byte(e.scripts.Get("idem_begin").Hash()))
	opts.Addr, opts.MaxRetries = proxy.addr(), -1 // the lost reply reaches the worker
	lossy := redis.NewClient(opts)
	defer lossy.Close()

	var runsA, runsB atomic.Int32
	a := e.workerOn(lossy, func(c *Config) { c.Consumer = "a"; c.DeferDelay = time.Second })
	a.Handle("jobs.run", func(ctx context.Context, task *Task) error { runsA.Add(1); return nil })
	task := New("jobs.run", nil)
	k := "lost-reply"
	task.IdempotencyKey = &k
	e.publish(task)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(runCtx) }()

	e.waitFor("the task to be handed back", func() bool {
		n, _ := e.client.HExists(ctx, e.q.DelayedData(), task.TaskID).Result()
		return n
	})
	idemKey := e.keys.Idempotency("jobs.run", k)
	if v, err := e.client.Get(ctx, idemKey).Result(); err != redis.Nil {
		t.Fatalf("the claim is left behind after the hand-back: %q (%v)", v, err)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	body, _ := e.client.HGet(ctx, e.q.DelayedData(), task.TaskID).Result()
	if !strings.Contains(body, `"retry_count":0`) || len(e.dead()) != 0 || runsA.Load() != 0 {
		t.Fatalf("not deferred unrun: body %s, dead %v, runs %d", body, e.dead(), runsA.Load())
	}
	if !strings.Contains(e.logs.String(), "idempotency claim failed; releasing it and deferring") {
		t.Fatal("the failed claim is not logged")
	}

	// Consumer a stays alive: a claim of its left behind would keep b deferring.
	e.client.Set(ctx, e.keys.Consumer("a"), "h 1 go", time.Minute)
	b := e.worker(func(c *Config) { c.Consumer = "b" })
	b.Handle("jobs.run", func(ctx context.Context, task *Task) error { runsB.Add(1); return nil })
	e.start(b)
	e.waitFor("the task to run on b", func() bool { return runsB.Load() == 1 })
	e.waitFor("the queue to drain", e.drained)
	time.Sleep(300 * time.Millisecond)
	if runsA.Load()+runsB.Load() != 1 || len(e.dead()) != 0 {
		t.Fatalf("runs a %d, b %d, dead %v", runsA.Load(), runsB.Load(), e.dead())
	}
	if v, _ := e.client.Get(ctx, idemKey).Result(); !strings.HasPrefix(v, "done "+task.TaskID+" ") {
		t.Fatalf("marker %q", v)
	}
	if strings.Contains(e.logs.String(), "taken over") {
		t.Fatal("a release of a claim that was not held is logged as a takeover")
	}
}

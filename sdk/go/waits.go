package envelope

import (
	"context"
	"sync"
	"time"
)

// waits are a consumer's blocking waits, one per queue and each on a
// connection of its own (go-redis takes one from the pool for every command in
// flight; on a Cluster, from the pool of the node of the queue's slot). A wait
// still in flight when the consumer reads again stays armed for the next round
// (with the slot-freed id it was sent with: section 19).
type waits struct {
	w        *Worker
	inFlight []bool
	woke     chan woke
	running  sync.WaitGroup
}

// woke is the end of queue i's wait: entries came, Block passed, or err.
type woke struct {
	i   int
	err error
}

func (w *Worker) newWaits() *waits {
	return &waits{w: w, inFlight: make([]bool, len(w.queues)), woke: make(chan woke, len(w.queues))}
}

// any arms the wait of every queue that has none in flight, then returns when
// the first of them ends (with its error), when poll passes (poll > 0: a queue
// has parked entries, to read again within their wait_ms even if nothing new
// comes; the waits stay armed) or when ctx ends.
func (ws *waits) any(ctx context.Context, poll time.Duration) error {
	for i, q := range ws.w.queues {
		if ws.inFlight[i] {
			continue
		}
		ws.inFlight[i] = true
		freedAfter := ws.w.limitStates[q.Queue].freedAfter // read here: limitStates is the loop's
		ws.running.Go(func() { ws.woke <- woke{i, ws.w.wait(ctx, q, freedAfter)} })
	}
	var timeout <-chan time.Time
	if poll > 0 {
		timer := time.NewTimer(poll)
		defer timer.Stop()
		timeout = timer.C
	}
	select {
	case <-ctx.Done():
		return nil
	case <-timeout:
		return nil
	case r := <-ws.woke:
		ws.inFlight[r.i] = false
		return r.err
	}
}

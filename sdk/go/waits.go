package envelope

import (
	"context"
	"sync"
)

// waits are a consumer's blocking waits, one per queue and each on a
// connection of its own (go-redis takes one from the pool for every command in
// flight; on a Cluster, from the pool of the node of the queue's slot). A wait
// still in flight when the consumer reads again stays armed for the next round.
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
// the first of them ends (with its error) or ctx ends.
func (ws *waits) any(ctx context.Context) error {
	for i, q := range ws.w.queues {
		if ws.inFlight[i] {
			continue
		}
		ws.inFlight[i] = true
		ws.running.Go(func() { ws.woke <- woke{i, ws.w.wait(ctx, q)} })
	}
	select {
	case <-ctx.Done():
		return nil
	case r := <-ws.woke:
		ws.inFlight[r.i] = false
		return r.err
	}
}

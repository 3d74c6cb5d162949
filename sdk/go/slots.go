package envelope

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// limitState is what the last read.lua call of a queue answered about the
// limits of its task types (docs/protocol.md section 19).
type limitState struct {
	limited    bool   // the queue has limits: its entries may hold concurrency slots
	waitMS     int64  // read again within this many ms: entries are parked; -1 when none are
	freedAfter string // entries wait for a slot: wait on slot-freed from this id; "" when none do
}

// parseRead reads read.lua's reply {reply, wait_ms, limited, freed_after}.
func parseRead(reply any) ([]redis.XStream, limitState, error) {
	parts, ok := reply.([]any)
	if !ok || len(parts) != 4 {
		return nil, limitState{}, fmt.Errorf("read.lua: unexpected reply %v", reply)
	}
	waitMS, ok := parts[1].(int64)
	limited, ok2 := parts[2].(int64)
	freedAfter, ok3 := parts[3].(string)
	if !ok || !ok2 || !ok3 {
		return nil, limitState{}, fmt.Errorf("read.lua: unexpected wait_ms %v, limited %v or freed_after %v",
			parts[1], parts[2], parts[3])
	}
	streams, err := parseStreams(parts[0])
	return streams, limitState{limited: limited == 1, waitMS: waitMS, freedAfter: freedAfter}, err
}

// pollAfter is how soon the consumer reads again without new entries: the
// shortest wait_ms of its queues with parked entries, 0 when none has any.
func (w *Worker) pollAfter() time.Duration {
	soonest := time.Duration(0)
	for _, state := range w.limitStates {
		if d := time.Duration(state.waitMS) * time.Millisecond; state.waitMS >= 0 && (soonest == 0 || d < soonest) {
			soonest = max(d, time.Millisecond)
		}
	}
	return soonest
}

// slot is the concurrency slot an entry of a limited queue may hold: member
// "<stream> <entry id>" of <prefix>:{<queue>}:running:<task_type>.
type slot struct {
	q           QueueKeys
	key, member string
}

// heldSlots are the slots of the entries this consumer holds from limited
// queues, renewed with each liveness renewal. Safe for concurrent use.
type heldSlots struct {
	mu   sync.Mutex
	held map[string]slot // by member
}

func (h *heldSlots) add(s slot) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.held == nil {
		h.held = map[string]slot{}
	}
	h.held[s.member] = s
}

func (h *heldSlots) drop(members ...string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, m := range members {
		delete(h.held, m)
	}
}

// byQueue groups the slots held by queue (one MULTI each: section 2).
func (h *heldSlots) byQueue() map[QueueKeys][]slot {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := map[QueueKeys][]slot{}
	for _, s := range h.held {
		out[s.q] = append(out[s.q], s)
	}
	return out
}

// holdSlot gives e the slot of its task type when its queue has limits: the
// slot is renewed while e is held and freed by the step that settles it.
func (w *Worker) holdSlot(e *entry) {
	if !w.limitStates[e.q.Queue].limited {
		return
	}
	e.slot = &slot{q: e.q, key: e.q.Running(e.env.TaskType), member: e.stream + " " + e.id}
	w.slots.add(*e.slot)
}

// freeSlot adds the release of e's slot to the MULTI p that acknowledges e
// (retry.lua, dead_letter.lua and requeue.lua free it themselves).
func (e *entry) freeSlot(ctx context.Context, p redis.Pipeliner) {
	if e.slot != nil {
		p.ZRem(ctx, e.slot.key, e.slot.member)
		p.XAdd(ctx, &redis.XAddArgs{Stream: e.slot.q.SlotFreed(), NoMkStream: true, MaxLen: 1,
			Values: []any{"t", e.env.TaskType}})
	}
}

// withoutFreedNil is the first error of a MULTI's commands other than the nil
// answer of the XADD NOMKSTREAM that freeSlot adds (slot-freed does not exist
// while nothing waits for a slot), which go-redis reports as redis.Nil.
func withoutFreedNil(cmds []redis.Cmder, err error) error {
	if !errors.Is(err, redis.Nil) {
		return err
	}
	for _, cmd := range cmds {
		if e := cmd.Err(); e != nil && !errors.Is(e, redis.Nil) {
			return e
		}
	}
	return nil
}

// renewSlots pushes the deadline of every slot held to now + lease, one MULTI
// per queue of ZADD XX (a slot freed meanwhile is not taken again). A failure
// is logged: the next renewal tries again, and a slot lost meanwhile only lets
// one more attempt start.
func (w *Worker) renewSlots(ctx context.Context) {
	for q, held := range w.slots.byQueue() {
		deadline := float64(time.Now().Add(w.cfg.Lease).UnixMilli())
		_, err := w.client.TxPipelined(ctx, func(p redis.Pipeliner) error {
			for _, s := range held {
				p.ZAddXX(ctx, s.key, redis.Z{Score: deadline, Member: s.member})
			}
			return nil
		})
		if err != nil {
			w.logFor(q).Warn("renewing the concurrency slots failed", "slots", len(held), "error", err.Error())
		}
	}
}

// heldMembers are the slot members of the entries of a batch.
func heldMembers(streams []redis.XStream) []string {
	var out []string
	for _, s := range streams {
		for _, m := range s.Messages {
			out = append(out, s.Stream+" "+m.ID)
		}
	}
	return out
}

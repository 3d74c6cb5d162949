package envelope

import (
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

func TestDurabilityNeedsAClientThatCanWaitOnTheWritingConnection(t *testing.T) {
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
	defer ring.Close()
	_, err := NewWorker(ring, DefaultScripts(), Config{Queue: "q", Durability: Durability{Replicas: 1}})
	if err == nil || !strings.Contains(err.Error(), "durability") {
		t.Fatalf("a Ring client with Durability: %v", err)
	}
	if _, err := NewWorker(ring, DefaultScripts(), Config{Queue: "q"}); err != nil {
		t.Fatalf("a Ring client without Durability: %v", err)
	}
}

package agent

import (
	"sync"
	"testing"
	"time"
)

// fakeCount is a count of replicas the test sets, as replicas.Counter
// gives it.
type fakeCount struct {
	mu      sync.Mutex
	n       int
	changed chan struct{}
}

func newFakeCount(n int) *fakeCount { return &fakeCount{n: n, changed: make(chan struct{})} }

func (c *fakeCount) Count() (int, <-chan struct{}) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n, c.changed
}

func (c *fakeCount) set(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n = n
	close(c.changed)
	c.changed = make(chan struct{})
}

func TestAgentsHearHowManyReplicasThereAreAndEachChange(t *testing.T) {
	count := newFakeCount(3)
	b := startBroker(t, config{replicas: count})
	a := b.connectAgent(t, agentA, "a", "root")
	if got := a.next(t).GetReplicas(); got.GetCount() != 3 {
		t.Fatalf("after registered: %v, want replicas 3", got)
	}
	count.set(4)
	if got := a.next(t).GetReplicas(); got.GetCount() != 4 {
		t.Fatalf("after a fourth replica: %v, want replicas 4", got)
	}
}

func TestAgentsHearNoCountUntilTheBrokerHasOne(t *testing.T) {
	count := newFakeCount(0)
	b := startBroker(t, config{replicas: count})
	a := b.connectAgent(t, agentA, "a", "root")
	count.set(2)
	// The first message after registered is the first count, not a zero.
	if got := a.next(t).GetReplicas(); got.GetCount() != 2 {
		t.Fatalf("%v, want replicas 2 as the first count", got)
	}
}

func TestRegisteredSaysWhenTheBrokerAsksForANewConnection(t *testing.T) {
	b := startBroker(t, config{maxConnectionAge: 10 * time.Minute})
	a := b.connectAgent(t, agentA, "a", "root")
	if got := a.registered.GetMaxConnectionAge().AsDuration(); got != 10*time.Minute {
		t.Errorf("max_connection_age %v, want 10m", got)
	}
	off := startBroker(t, config{})
	if got := off.connectAgent(t, agentA, "a", "root").registered.GetMaxConnectionAge(); got != nil {
		t.Errorf("max_connection_age %v from a broker that never asks, want none", got)
	}
}

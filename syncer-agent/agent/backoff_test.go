package agent

import (
	"testing"
	"time"
)

func TestBackoffDoublesUpToMaxWithJitterInUpperHalf(t *testing.T) {
	b := newBackoff(250*time.Millisecond, 30*time.Second)
	// The ceiling of each wait: doubling from min, capped at max.
	ceilings := []time.Duration{
		250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second, 4 * time.Second,
		8 * time.Second, 16 * time.Second, 30 * time.Second, 30 * time.Second, 30 * time.Second,
	}
	for i, ceiling := range ceilings {
		if d := b.next(); d < ceiling/2 || d > ceiling {
			t.Errorf("wait %d: %v, want within [%v, %v]", i, d, ceiling/2, ceiling)
		}
	}
}

func TestBackoffResetStartsFromMinAgain(t *testing.T) {
	b := newBackoff(time.Second, time.Minute)
	for range 10 {
		b.next()
	}
	b.reset()
	if d := b.next(); d < time.Second/2 || d > time.Second {
		t.Errorf("first wait after reset: %v, want within [500ms, 1s]", d)
	}
}

func TestBackoffJittersWaits(t *testing.T) {
	// Agents that lost the same broker must not come back in lockstep:
	// waits of the same step differ. 100 equal draws from half a second of
	// nanoseconds do not happen by chance.
	seen := map[time.Duration]bool{}
	for range 100 {
		b := newBackoff(time.Second, time.Second)
		seen[b.next()] = true
	}
	if len(seen) < 2 {
		t.Errorf("100 first waits were all %v", seen)
	}
}

package agent

import (
	"math/rand/v2"
	"time"
)

// backoff is exponential with jitter (each wait drawn from [d/2, d]), so
// agents that lost the same broker do not come back in lockstep.
type backoff struct {
	min, max, cur time.Duration
}

func newBackoff(min, max time.Duration) *backoff { return &backoff{min: min, max: max, cur: min} }

func (b *backoff) next() time.Duration {
	d := b.cur/2 + rand.N(b.cur/2+1)
	b.cur = min(b.cur*2, b.max)
	return d
}

func (b *backoff) reset() { b.cur = b.min }

package quota

import (
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

var (
	kcp   = spiffeid.RequireFromString("spiffe://example.org/kcp")
	shard = spiffeid.RequireFromString("spiffe://example.org/shard")
)

func TestTakeNRefusesWhatWouldPassAnIDsBound(t *testing.T) {
	q := &Quota{PerID: 10}
	release, over := q.TakeN(kcp, 8)
	if over != Under {
		t.Fatalf("8 of 10: %v, want Under", over)
	}
	if _, over := q.TakeN(kcp, 3); over != OverPerID {
		t.Fatalf("8 held, 3 more of 10: %v, want OverPerID", over)
	}
	if _, over := q.TakeN(kcp, 2); over != Under {
		t.Fatalf("8 held, 2 more of 10: %v, want Under", over)
	}
	if _, over := q.TakeN(shard, 10); over != Under {
		t.Fatalf("another ID's 10: %v, want Under: the bound is per ID", over)
	}
	release()
	release() // counts once
	if got := q.Held(kcp); got != 2 {
		t.Fatalf("after the release kcp holds %d, want 2", got)
	}
}

func TestTakeNRefusesWhatWouldPassTheTotal(t *testing.T) {
	q := &Quota{PerID: 10, Total: 12}
	if _, over := q.TakeN(kcp, 10); over != Under {
		t.Fatalf("10 of 12: %v, want Under", over)
	}
	release, over := q.TakeN(shard, 2)
	if over != Under {
		t.Fatalf("12 of 12: %v, want Under", over)
	}
	if _, over := q.TakeN(shard, 1); over != OverTotal {
		t.Fatalf("13 of 12: %v, want OverTotal", over)
	}
	release()
	if got := q.TotalHeld(); got != 10 {
		t.Fatalf("after the release all hold %d, want 10", got)
	}
}

func TestTakeIsTakeNOfOne(t *testing.T) {
	q := &Quota{PerID: 1}
	release, over := q.Take(kcp)
	if over != Under {
		t.Fatalf("first: %v, want Under", over)
	}
	if _, over := q.Take(kcp); over != OverPerID {
		t.Fatalf("second of 1: %v, want OverPerID", over)
	}
	release()
	if _, over := q.Take(kcp); over != Under {
		t.Fatalf("after the release: %v, want Under", over)
	}
}

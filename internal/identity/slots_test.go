package identity

import (
	"crypto/tls"
	"net"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// stall opens a connection that never says a word.
func stall(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByServer waits until the server closes c.
func closedByServer(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(waitLong))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("the server wrote to a stalled connection")
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("the server did not close the stalled connection")
	}
}

func TestStalledHandshakesGiveWayAndFreshOnesAreNotDropped(t *testing.T) {
	ca := newCA(t, "ca")
	var refusals counts
	creds := ServerCredentials(newSource(t, ca, devca.Leaf{SPIFFEID: "/broker"}), tlsconfig.AuthorizeAny(),
		MaxConcurrentHandshakes(2), ReportRefusals(&Refusals{Count: refusals.count}))
	slots := findDecorator[*slottedCreds](t, creds).slots
	clock := &fakeClock{now: time.Now()}
	slots.now = clock.Now
	addr, results := serve(t, creds)
	good := attackerConfig(rawCert(t, ca, devca.Leaf{SPIFFEID: "/kcp"}))

	first := stall(t, addr)
	testutil.Eventually(t, "the first stalled handshake to take a slot", func() bool { return slots.inUse() == 1 })
	clock.advance(time.Millisecond)
	second := stall(t, addr)
	testutil.Eventually(t, "both stalled handshakes to take a slot", func() bool { return slots.inUse() == 2 })

	// Both slots are taken by handshakes that just began: a new one is
	// turned away, the others keep theirs.
	wantTurnedAwayOverLimit(t, addr, good, results)
	if slots.inUse() != 2 {
		t.Fatalf("%d handshakes in progress, want the 2 stalled ones", slots.inUse())
	}

	// A second later they have stalled: the oldest makes room for a new
	// handshake, which succeeds.
	clock.advance(2 * stalledAfter)
	if _, err := dialAndRead(addr, good); err != nil {
		t.Fatalf("a handshake did not take a stalled one's place: %v", err)
	}
	closedByServer(t, first)
	wantOneEvictedAndOnePassed(t, results)
	if got := refusals.get(ReasonOverLimit); got != 2 {
		t.Errorf("counted %d handshakes over the limit, want 2", got)
	}
	// The younger stalled handshake still holds its slot.
	if slots.inUse() != 1 {
		t.Errorf("%d handshakes in progress, want 1", slots.inUse())
	}
	second.Close()
	testutil.Eventually(t, "the last slot to be freed", func() bool { return slots.inUse() == 0 })
}

// wantTurnedAwayOverLimit dials addr with cfg and wants the handshake
// refused, and the server to report it refused as over the limit.
func wantTurnedAwayOverLimit(t *testing.T, addr string, cfg *tls.Config, results <-chan handshake) {
	t.Helper()
	if _, err := dialAndRead(addr, cfg); err == nil {
		t.Fatal("a handshake past the bound was admitted")
	}
	if r := next(t, results); ReasonOf(r.err) != ReasonOverLimit {
		t.Fatalf("refused for %q (%v), want %q", ReasonOf(r.err), r.err, ReasonOverLimit)
	}
}

// wantOneEvictedAndOnePassed wants the server's next two handshakes to be
// one that ended over the limit, the stalled one evicted, and one that
// passed, in either order: the two finish on their own goroutines.
func wantOneEvictedAndOnePassed(t *testing.T, results <-chan handshake) {
	t.Helper()
	var evicted, passed int
	for range 2 {
		r := next(t, results)
		switch {
		case r.err == nil:
			passed++
		case ReasonOf(r.err) == ReasonOverLimit:
			evicted++
		default:
			t.Fatalf("unexpected handshake failure: %v", r.err)
		}
	}
	if evicted != 1 || passed != 1 {
		t.Fatalf("%d evicted and %d passed, want one each", evicted, passed)
	}
}

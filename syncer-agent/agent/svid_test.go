package agent

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/peer"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

// rotatingSVID is an SVID source whose SVID the test replaces.
type rotatingSVID struct {
	mu   sync.Mutex
	svid *x509svid.SVID
	err  error
}

func (s *rotatingSVID) GetX509SVID() (*x509svid.SVID, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.svid, s.err
}

func (s *rotatingSVID) set(svid *x509svid.SVID, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.svid, s.err = svid, err
}

// agentSVID issues a new SVID for the agent's SPIFFE ID.
func (p *pki) agentSVID(t *testing.T) *x509svid.SVID {
	t.Helper()
	return p.agentSVIDFor(t, time.Time{}, time.Time{})
}

// agentSVIDFor issues a new SVID for the agent's SPIFFE ID, valid from
// notBefore to notAfter (zero: devca's defaults).
func (p *pki) agentSVIDFor(t *testing.T, notBefore, notAfter time.Time) *x509svid.SVID {
	t.Helper()
	src, err := p.ca.Source(devca.Leaf{SPIFFEID: p.agentID.Path(), NotBefore: notBefore, NotAfter: notAfter})
	if err != nil {
		t.Fatal(err)
	}
	svid, err := src.GetX509SVID()
	if err != nil {
		t.Fatal(err)
	}
	return svid
}

func TestAnSVIDHasRotatedOnlyWhenItsLeafCertificateChanged(t *testing.T) {
	p := newPKI(t)
	first, second := p.agentSVID(t), p.agentSVID(t)
	source := &rotatingSVID{svid: first}
	w := watchSVID(source)

	if w.rotated() {
		t.Error("rotated, with the SVID it started with")
	}
	// The same certificate, read again (a source re-reads its files when
	// the bundle changes): no rotation.
	source.set(&x509svid.SVID{ID: first.ID, Certificates: first.Certificates, PrivateKey: first.PrivateKey}, nil)
	if w.rotated() {
		t.Error("rotated, with the same certificate read again")
	}
	source.set(second, nil)
	if !w.rotated() {
		t.Error("not rotated, with a new certificate")
	}
	if w.rotated() {
		t.Error("rotated twice for one new certificate")
	}
	// A source that fails for a while has not rotated, nor has it when
	// it comes back with the SVID it had.
	source.set(nil, errors.New("the Workload API is away"))
	if w.rotated() {
		t.Error("rotated, with a source that fails")
	}
	source.set(second, nil)
	if w.rotated() {
		t.Error("rotated, with the SVID the source had before it failed")
	}
}

// An SVID that is not renewed is warned of in the last quarter of its
// lifetime, once a minute at most, and again for a new one only when it
// too runs out.
func TestAnSVIDNotRenewedIsWarnedOfInTheLastQuarterOfItsLifetime(t *testing.T) {
	p := newPKI(t)
	start := time.Now().Truncate(time.Second)
	issue := func(from time.Time) *x509svid.SVID { return p.agentSVIDFor(t, from, from.Add(time.Hour)) }
	source := &rotatingSVID{svid: issue(start)}
	w := watchSVID(source)
	for _, tc := range []struct {
		at   time.Duration
		warn bool
	}{
		{30 * time.Minute, false}, // renewed at half its lifetime, by SPIRE
		{44 * time.Minute, false},
		{46 * time.Minute, true},
		{46*time.Minute + 30*time.Second, false}, // once a minute
		{47*time.Minute + 30*time.Second, true},
		{61 * time.Minute, false}, // expired: the failure to connect says so
	} {
		left, notAfter, warn := w.expiring(start.Add(tc.at))
		if warn != tc.warn || left != time.Hour-tc.at || !notAfter.Equal(start.Add(time.Hour)) {
			t.Errorf("at %v: warn %v, %v left, expiry %v; want warn %v, %v left", tc.at, warn, left, notAfter, tc.warn, time.Hour-tc.at)
		}
	}
	// A new SVID: the count starts again.
	source.set(issue(start.Add(time.Hour)), nil)
	if !w.rotated() {
		t.Fatal("not rotated")
	}
	if _, _, warn := w.expiring(start.Add(time.Hour + 50*time.Minute)); !warn {
		t.Error("the new SVID, not renewed either, is not warned of")
	}
}

func TestFleetMovesToNewConnectionsWhenItsSVIDRotatesAndDrainsTheOldOnes(t *testing.T) {
	h := newFleet(t, []string{"a.test:8443"}, false, "a.test:8443")
	source := &rotatingSVID{svid: h.pki.agentSVID(t)}
	h.fleet.SVID = source
	h.fleet.CheckSVIDEvery = time.Minute
	h.run()
	old := h.session("a.test:8443")

	source.set(h.pki.agentSVID(t), nil)
	h.clock.Step(time.Minute)
	// A new agent registers on a connection of its own, with whatever SVID
	// the source holds now...
	fresh := h.session("a.test:8443")
	if a, b := remoteOf(t, old), remoteOf(t, fresh); a == b {
		t.Fatalf("the new registration came over the old connection (%s)", a)
	}
	// ...and only then does the old one drain and end its registration.
	if m := old.next(t); m.GetDrain() == nil {
		t.Fatalf("the old agent sent %T, want a drain", m.GetMessage())
	}
	old.ended(t)
	if registered, known := h.fleet.Registered(); registered != 1 || known != 1 {
		t.Errorf("%d of %d replicas hold the agent's registration, want 1 of 1", registered, known)
	}
	if !h.fleet.Ready() {
		t.Error("the fleet is not ready on its new connections")
	}
	select {
	case m := <-fresh.msgs:
		t.Errorf("the new agent sent %T, want nothing", m.GetMessage())
	default:
	}
}

func remoteOf(t *testing.T, s *session) string {
	t.Helper()
	p, ok := peer.FromContext(s.stream.Context())
	if !ok {
		t.Fatal("no peer")
	}
	return p.Addr.String()
}

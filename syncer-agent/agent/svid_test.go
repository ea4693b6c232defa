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
	src, err := p.ca.Source(devca.Leaf{SPIFFEID: p.agentID.Path()})
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

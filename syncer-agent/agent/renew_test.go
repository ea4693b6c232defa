package agent

import (
	"testing"

	"google.golang.org/grpc/peer"
)

func TestFleetMovesToNewConnectionsWhenRenewedAndDrainsTheOldOnes(t *testing.T) {
	h := newFleet(t, []string{"a.test:8443"}, false, "a.test:8443")
	renew := make(chan struct{})
	h.fleet.Renew = renew
	h.run()
	old := h.session("a.test:8443")

	renew <- struct{}{}
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

package registry

import (
	"testing"
	"time"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// fakeCarrier is an idle data connection that records what it carried.
type fakeCarrier struct {
	carried chan *tunnelv1.DialOrder
	dropped chan struct{}
}

func newFakeCarrier() *fakeCarrier {
	return &fakeCarrier{carried: make(chan *tunnelv1.DialOrder, 1), dropped: make(chan struct{})}
}

func (c *fakeCarrier) Carry(order *tunnelv1.DialOrder) { c.carried <- order }
func (c *fakeCarrier) Drop()                           { close(c.dropped) }

// dialOnCarrier starts a dial to root, whose one agent has one idle
// carrier, and returns the order the carrier carried.
func dialOnCarrier(t *testing.T) (*Registry, *Agent, *fakeCarrier, *dialing, *tunnelv1.DialOrder) {
	t.Helper()
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	c := newFakeCarrier()
	if !a.AddCarrier(c) {
		t.Fatal("a registered agent refused a carrier")
	}
	d := startDial(t, r, target("root"))
	select {
	case order := <-c.carried:
		return r, a, c, d, order
	case <-time.After(waitLong):
		t.Fatal("the dial's order did not go on the agent's idle carrier")
		return nil, nil, nil, nil, nil
	}
}

func TestADialGoesOnAnIdleCarrierOfItsAgentAndTheNextOnTheControlStream(t *testing.T) {
	r, a, c, first, order := dialOnCarrier(t)
	// The carrier's answer claims the dial as a Tunnel's open does.
	claim, err := r.Claim(order.GetDialId(), a.ID)
	if err != nil {
		t.Fatal(err)
	}
	claim.HandOver(newFakeTunnel())
	first.connected().Release()
	// Taken, the carrier is no longer idle: the next order goes on the
	// control stream.
	startDial(t, r, target("root"))
	nextOrder(t, a)
	if a.RemoveCarrier(c) {
		t.Error("a carrier an order took was still idle")
	}
}

func TestACarriersFailedAnswerFailsTheDial(t *testing.T) {
	r, a, _, d, order := dialOnCarrier(t)
	r.Fail(a, &tunnelv1.DialFailure{DialId: order.GetDialId(), Code: 5, Message: "no such Service"})
	if o := d.wait(); o.err == nil || o.claim != nil {
		t.Fatalf("the dial whose carrier failed it ended with %v, %v; want its failure", o.claim, o.err)
	}
}

func TestAnEndedRegistrationDropsItsIdleCarriersAndTakesNoMore(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	c := newFakeCarrier()
	a.AddCarrier(c)
	r.Unregister(a)
	select {
	case <-c.dropped:
	case <-time.After(waitLong):
		t.Fatal("an idle carrier of an ended registration was not dropped")
	}
	if a.AddCarrier(newFakeCarrier()) {
		t.Error("an ended registration took a carrier")
	}
}

func TestASessionIsFoundOnlyForItsOwnAgent(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	b := registerAgent(t, r, "b", "root")
	if got, ok := r.Session(a.SessionID, a.ID); !ok || got != a {
		t.Errorf("Session(a's, a) = %v, %v; want a", got, ok)
	}
	if _, ok := r.Session(a.SessionID, b.ID); ok {
		t.Error("agent b found agent a's session")
	}
	r.Unregister(a)
	if _, ok := r.Session(a.SessionID, a.ID); ok {
		t.Error("an ended registration's session was found")
	}
}

func TestADialLostOnItsCarrierIsResentOnceOnTheControlStream(t *testing.T) {
	r, a, _, d, order := dialOnCarrier(t)
	if !r.Resend(a, order.GetDialId()) {
		t.Fatal("a pending dial was not resent")
	}
	if again := nextOrder(t, a); again.GetDialId() != order.GetDialId() || again.GetTimeoutMs() == 0 {
		t.Fatalf("the control stream carried %v, want dial %d again with what is left of its timeout", again, order.GetDialId())
	}
	if r.Resend(a, order.GetDialId()) {
		t.Error("a dial was resent twice")
	}
	r.Fail(a, &tunnelv1.DialFailure{DialId: order.GetDialId(), Code: 14, Message: "refused"})
	if o := d.wait(); o.err == nil {
		t.Fatal("the resent dial's failure did not end it")
	}
	if r.Resend(a, order.GetDialId()) {
		t.Error("a dial no longer pending was resent")
	}
}

package agent

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Standby streams (standby.go): Tunnel streams an agent opens ahead of its
// dials, on which the broker writes a dial's order instead of on the
// control stream.

// standby opens a standby stream of a's registration as path, and waits
// until the broker holds it idle.
func (b *broker) standby(t *testing.T, path string, a *agent) tunnelv1.AgentService_TunnelClient {
	t.Helper()
	tun := b.openStandby(t, path, a.registration.GetRegistrationId())
	testutil.Eventually(t, "the standby to be idle", func() bool { return b.registered(a.name).Standbys() == 1 })
	return tun
}

func (b *broker) openStandby(t *testing.T, path, registration string) tunnelv1.AgentService_TunnelClient {
	t.Helper()
	ctx, _ := brokertest.StreamContext(t)
	tun, err := tunnelv1.NewAgentServiceClient(b.Conn(t, path)).Tunnel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tun.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{StandbyFor: registration}}}); err != nil {
		t.Fatal(err)
	}
	return tun
}

// standbyOrder is the standby stream's first message, which must be a dial
// order.
func standbyOrder(t *testing.T, tun tunnelv1.AgentService_TunnelClient) *tunnelv1.DialOrder {
	t.Helper()
	msg, err := tun.Recv()
	if err != nil || msg.GetDialOrder() == nil {
		t.Fatalf("the standby got %v, %v; want a dial order", msg, err)
	}
	return msg.GetDialOrder()
}

func openOn(t *testing.T, tun tunnelv1.AgentService_TunnelClient, dialID uint64) {
	t.Helper()
	if err := tun.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: dialID}}}); err != nil {
		t.Fatal(err)
	}
}

func TestTheRegistrationNamesItselfForStandbyStreams(t *testing.T) {
	a := startBroker(t, config{}).connectAgent(t, agentA, "a", "root")
	if a.registration.GetRegistrationId() == "" || a.registration.GetMaxStandbyStreams() != DefaultMaxStandbyStreams {
		t.Errorf("registered %v, want a registration id and %d standby streams", a.registration, DefaultMaxStandbyStreams)
	}
	none := startBroker(t, config{maxStandby: -1}).connectAgent(t, agentA, "a", "root")
	if none.registration.GetRegistrationId() != "" || none.registration.GetMaxStandbyStreams() != 0 {
		t.Errorf("a broker without standby streams registered %v", none.registration)
	}
}

func TestADialTakesAnIdleStandbyStreamWhoseOpenCarriesTheTunnel(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	tun := b.standby(t, agentA, a)
	dial, _ := b.StartDialWith(t, kcpPath, brokertest.Target("root"), []byte("client hello"))
	order := standbyOrder(t, tun)
	if string(order.GetEarlyData()) != "client hello" || order.GetTimeoutMs() == 0 {
		t.Fatalf("the standby's order %v, want the early data and a timeout", order)
	}
	openOn(t, tun, order.GetDialId())
	established(t, dial)
	if err := dial.Send(brokertest.DataUp([]byte("ping"))); err != nil {
		t.Fatal(err)
	}
	if msg, err := tun.Recv(); err != nil || string(msg.GetData()) != "ping" {
		t.Fatalf("the agent got %v, %v; want ping", msg, err)
	}
	if err := tun.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: []byte("pong")}}); err != nil {
		t.Fatal(err)
	}
	if msg, err := dial.Recv(); err != nil || string(msg.GetData()) != "pong" {
		t.Fatalf("the caller got %v, %v; want pong", msg, err)
	}
	// The control stream carried no order.
	select {
	case msg := <-a.msgs:
		t.Errorf("the control stream carried %v", msg)
	default:
	}
}

func TestWithoutAnIdleStandbyTheOrderGoesOnTheControlStream(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	b.startDial(t, brokertest.Target("root"))
	a.order(t, brokertest.Target("root"))
}

func TestAnOrderOnAStandbyThatTheAgentCannotServeFailsOnTheControlStream(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	tun := b.standby(t, agentA, a)
	dial := b.startDial(t, brokertest.Target("root"))
	order := standbyOrder(t, tun)
	a.fail(t, order.GetDialId(), codes.NotFound, "no Service default/webhook")
	if err := tun.CloseSend(); err != nil {
		t.Fatal(err)
	}
	testutil.CheckStatus(t, "dial", dialStatus(t, dial), codes.NotFound, "no Service default/webhook")
	if err := tunnelStatus(t, tun); err != nil {
		t.Errorf("the standby ended with %v, want OK", err)
	}
}

func TestAStandbyOfAnotherAgentsRegistrationIsNotFound(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	testutil.CheckStatus(t, "standby", tunnelStatus(t, b.openStandby(t, agentB, a.registration.GetRegistrationId())),
		codes.NotFound, "no registration")
	testutil.CheckStatus(t, "standby", tunnelStatus(t, b.openStandby(t, agentA, "no-such-registration")),
		codes.NotFound, "no registration")
}

func TestStandbysPastTheBoundAreRefused(t *testing.T) {
	b := startBroker(t, config{maxStandby: 1})
	a := b.connectAgent(t, agentA, "a", "root")
	b.standby(t, agentA, a)
	testutil.CheckStatus(t, "a second standby", tunnelStatus(t, b.openStandby(t, agentA, a.registration.GetRegistrationId())),
		codes.ResourceExhausted, "standby streams, the most it may")
}

func TestAnIdleStandbyEndsWithItsRegistration(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	tun := b.standby(t, agentA, a)
	a.cancel()
	testutil.CheckStatus(t, "standby", tunnelStatus(t, tun), codes.Unavailable, "registration ended")
}

func TestAnIdleStandbyTheAgentHalfClosesEndsWithOK(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	tun := b.standby(t, agentA, a)
	if err := tun.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if err := tunnelStatus(t, tun); err != nil {
		t.Errorf("the standby ended with %v, want OK", err)
	}
	testutil.Eventually(t, "the standby to be gone", func() bool { return b.registered("a").Standbys() == 0 })
}

func TestAnIdleStandbyThatSendsSomethingBreaksTheProtocol(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	tun := b.standby(t, agentA, a)
	if err := tun.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: []byte("unasked")}}); err != nil {
		t.Fatal(err)
	}
	testutil.CheckStatus(t, "standby", tunnelStatus(t, tun), codes.InvalidArgument, "may send nothing")
}

func TestAStandbyWhoseAgentCancelsItAfterTheOrderFailsTheDialUnavailable(t *testing.T) {
	b := startBroker(t, config{})
	a := b.connectAgent(t, agentA, "a", "root")
	ctx, cancel := brokertest.StreamContext(t)
	tun, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentA)).Tunnel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	openFirst := &tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{StandbyFor: a.registration.GetRegistrationId()}}}
	if err := tun.Send(openFirst); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the standby to be idle", func() bool { return b.registered("a").Standbys() == 1 })
	dial := b.startDial(t, brokertest.Target("root"))
	standbyOrder(t, tun)
	cancel()
	testutil.CheckStatus(t, "dial", dialStatus(t, dial), codes.Unavailable, "standby stream ended before it answered")
}

func TestAStandbyWhoseOrderIsNotAnsweredInTimeFailsTheDial(t *testing.T) {
	b := startBroker(t, config{dialTimeout: 200 * time.Millisecond})
	a := b.connectAgent(t, agentA, "a", "root")
	tun := b.standby(t, agentA, a)
	dial := b.startDial(t, brokertest.Target("root"))
	standbyOrder(t, tun)
	testutil.CheckStatus(t, "dial", dialStatus(t, dial), codes.DeadlineExceeded, "")
	// The standby ends too, at the order's timeout and a second more.
	testutil.CheckStatus(t, "standby", tunnelStatus(t, tun), codes.DeadlineExceeded, "no answer to the dial order")
}

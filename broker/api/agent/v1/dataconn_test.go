package agent

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// These tests play the agent's data connections (docs/protocol.md §3.5) by
// hand, with package wire's messages, and kcp on Dial streams.

// readFull reads exactly len(want) bytes from r and compares them.
func readFull(t *testing.T, r io.Reader, want string) {
	t.Helper()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(r, got); err != nil || string(got) != want {
		t.Fatalf("read %q, %v; want %q", got, err, want)
	}
}

// orderOn reads the broker's next dial order on conn, an idle data
// connection, which must be for want.
func orderOn(t *testing.T, conn *tls.Conn, want *tunnelv1.Target) *tunnelv1.DialOrder {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(testutil.WaitLong))
	defer conn.SetReadDeadline(time.Time{})
	order, err := wire.ReadOrder(conn)
	if err != nil {
		t.Fatalf("waiting for a dial order on the data connection: %v", err)
	}
	if !proto.Equal(order.GetTarget(), want) {
		t.Fatalf("order for %v, want %v", order.GetTarget(), want)
	}
	return order
}

// acceptOn answers the order just read on conn with OK, and returns the
// agent's leg of its tunnel.
func acceptOn(t *testing.T, conn *tls.Conn) *wire.Leg {
	t.Helper()
	if err := wire.WriteAnswer(conn, nil); err != nil {
		t.Fatal(err)
	}
	return wire.NewLeg(conn)
}

// establishData registers agent A for root with one data connection, and
// dials root as kcp with early data: the tunnel rides the data connection.
// It returns the caller's stream, the data connection and the agent's leg.
func (b *broker) establishData(t *testing.T) (tunnelv1.DialService_DialClient, context.CancelFunc, *tls.Conn, *wire.Leg) {
	t.Helper()
	a := b.ConnectAgentWith(t, agentA, &tunnelv1.Register{Clusters: []string{"root"}, AgentName: "a", AcceptsEarlyData: true})
	return b.establishOnSpare(t, a, []byte("client hello"))
}

// establishOnSpare is establishData for agent a, already registered, with
// early (none: nil).
func (b *broker) establishOnSpare(t *testing.T, a *brokertest.Agent, early []byte) (tunnelv1.DialService_DialClient, context.CancelFunc, *tls.Conn, *wire.Leg) {
	t.Helper()
	caller, cancel, conn, _ := b.dialOnSpare(t, a, early)
	leg := acceptOn(t, conn)
	established(t, caller)
	return caller, cancel, conn, leg
}

// dialOnSpare opens a data connection of agent a's, and dials root as kcp
// with early (none: nil): it returns the caller's stream and its cancel,
// and the data connection, which has read the dial's order, with the
// caller's early data, and not answered it yet, and the target.
func (b *broker) dialOnSpare(t *testing.T, a *brokertest.Agent, early []byte) (tunnelv1.DialService_DialClient, context.CancelFunc, *tls.Conn, *tunnelv1.Target) {
	t.Helper()
	conn := a.DataSpare(t, brokerID)
	waitForCarrier(t, b, agentA)
	target := brokertest.Target("root")
	caller, cancel := b.StartDialWith(t, kcpPath, target, early)
	order := orderOn(t, conn, target)
	if !bytes.Equal(order.GetEarlyData(), early) {
		t.Fatalf("the order carried %q, want the caller's early data %q", order.GetEarlyData(), early)
	}
	return caller, cancel, conn, target
}

// waitForCarrier waits until the broker holds the agent's idle data
// connection, bound: a dial then goes on it.
func waitForCarrier(t *testing.T, b *broker, path string) {
	t.Helper()
	testutil.Eventually(t, "the data connection to be idle", func() bool { return b.agents.spares.Held(brokertest.ID(path)) == 1 })
}

// orderOnSpare registers agent A for root with one data connection, and
// dials root as kcp: it returns the caller's stream and the data
// connection, which has read the dial's order and not answered it yet.
func (b *broker) orderOnSpare(t *testing.T) (tunnelv1.DialService_DialClient, *tls.Conn, *tunnelv1.Target) {
	t.Helper()
	caller, _, conn, target := b.orderOnSpareWith(t, nil)
	return caller, conn, target
}

// orderOnSpareWith is orderOnSpare of a dial with early data, which the
// agent accepts: it returns the agent too.
func (b *broker) orderOnSpareWith(t *testing.T, early []byte) (tunnelv1.DialService_DialClient, *brokertest.Agent, *tls.Conn, *tunnelv1.Target) {
	t.Helper()
	a := b.ConnectAgentWith(t, agentA, &tunnelv1.Register{Clusters: []string{"root"}, AgentName: "a", AcceptsEarlyData: early != nil})
	caller, _, conn, target := b.dialOnSpare(t, a, early)
	return caller, a, conn, target
}

func TestRegisteredNamesTheSessionDataConnectionsBindTo(t *testing.T) {
	b := startBroker(t, config{})
	a := b.ConnectAgent(t, agentA, "a", "root")
	other := b.ConnectAgent(t, agentA, "a2", "root")
	if a.Session == "" || a.Session == other.Session {
		t.Fatalf("sessions %q and %q, want two, each its own", a.Session, other.Session)
	}
}

func TestADialGoesOnAnIdleDataConnectionOfItsAgentAndCarriesTheTunnel(t *testing.T) {
	b := startBroker(t, config{})
	caller, _, _, leg := b.establishData(t)

	// Up: the caller's frames arrive as data frames, its half-close as a
	// close_write.
	if err := caller.Send(brokertest.DataUp([]byte("and more"))); err != nil {
		t.Fatal(err)
	}
	readFull(t, leg, "and more")
	if err := caller.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if n, err := leg.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("after the caller's half-close the agent read %d, %v; want EOF", n, err)
	}
	// Down: data frames become the caller's, and the agent's half-close
	// its close_write; then the Dial ends OK, and the broker's end says so.
	if _, err := leg.Write([]byte("server hello")); err != nil {
		t.Fatal(err)
	}
	if msg, err := caller.Recv(); err != nil || string(msg.GetData()) != "server hello" {
		t.Fatalf("caller got %v, %v; want the agent's data", msg, err)
	}
	if err := leg.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if msg, err := caller.Recv(); err != nil || msg.GetCloseWrite() == nil {
		t.Fatalf("caller got %v, %v; want close_write", msg, err)
	}
	if _, err := caller.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("the Dial ended with %v, want OK", err)
	}
	if err := leg.AwaitEnd(); err != nil {
		t.Fatalf("the broker ended the tunnel with %v, want OK", err)
	}
	if !leg.Finish() {
		t.Fatal("the data connection is not idle after the end exchange")
	}
}

func TestADataConnectionCarriesOneOrderAfterAnother(t *testing.T) {
	b := startBroker(t, config{})
	a := b.ConnectAgent(t, agentA, "a", "root")
	conn := a.DataSpare(t, brokerID)
	for i := range 3 {
		waitForCarrier(t, b, agentA)
		target := brokertest.Target("root")
		caller, cancel := b.StartDial(t, kcpPath, target)
		orderOn(t, conn, target)
		leg := acceptOn(t, conn)
		established(t, caller)
		msg := fmt.Sprintf("hello %d", i)
		if err := caller.Send(brokertest.DataUp([]byte(msg))); err != nil {
			t.Fatal(err)
		}
		readFull(t, leg, msg)
		// kcp goes away: the broker's end says so, and the exchange
		// leaves the connection idle for the next order.
		cancel()
		if _, err := leg.Read(make([]byte, 1)); status.Code(err) != codes.Canceled {
			t.Fatalf("tunnel %d: the agent read %v, want the broker's end with Canceled", i, err)
		}
		if !leg.Finish() {
			t.Fatalf("tunnel %d: the data connection is not idle after the end exchange", i)
		}
	}
}

func TestADialGoesOnTheControlStreamWhileTheAgentHasNoIdleDataConnection(t *testing.T) {
	b := startBroker(t, config{})
	a := b.ConnectAgent(t, agentA, "a", "root")
	// The agent's only data connection carries a tunnel: the next dial's
	// order comes on the control stream, and its tunnel on a stream.
	b.establishOnSpare(t, a, nil)
	target := brokertest.Target("root")
	caller, _ := b.StartDial(t, kcpPath, target)
	order := a.Order(t, target)
	a.Open(t, order.GetDialId())
	established(t, caller)
}

func TestTheAgentsFailedAnswerIsTheDialsFailureAndTheConnectionStaysIdle(t *testing.T) {
	b := startBroker(t, config{})
	caller, conn, target := b.orderOnSpare(t)
	if err := wire.WriteAnswer(conn, status.Error(codes.NotFound, "no Service default/webhook in logical cluster root")); err != nil {
		t.Fatal(err)
	}
	_, err := caller.Recv()
	testutil.CheckStatus(t, "the dial the agent failed", err, codes.NotFound, "no Service default/webhook in logical cluster root")
	// The connection is idle again, and takes the next order.
	waitForCarrier(t, b, agentA)
	caller, _ = b.StartDial(t, kcpPath, target)
	orderOn(t, conn, target)
	acceptOn(t, conn)
	established(t, caller)
}

func TestADialWhoseDataConnectionEndsBeforeItsAnswerIsOrderedAgainOnTheControlStream(t *testing.T) {
	b := startBroker(t, config{})
	// An order without early data: a second one does no harm, however the
	// connection ended.
	caller, a, conn, target := b.orderOnSpareWith(t, nil)
	conn.NetConn().Close()
	order := a.Order(t, target)
	a.Open(t, order.GetDialId())
	established(t, caller)
}

func TestADialWithEarlyDataWhoseSpareTheAgentClosedIsOrderedAgainOnTheControlStream(t *testing.T) {
	b := startBroker(t, config{})
	// The agent closes its idle spare cleanly as the order arrives: it
	// sent no answer, so the early data went nowhere.
	caller, a, conn, target := b.orderOnSpareWith(t, []byte("client hello"))
	conn.Close()
	order := a.Order(t, target)
	if string(order.GetEarlyData()) != "client hello" {
		t.Fatalf("the order again carried %q, want the caller's early data", order.GetEarlyData())
	}
	a.Open(t, order.GetDialId())
	established(t, caller)
}

func TestADialWithEarlyDataWhoseDataConnectionBreaksBeforeItsAnswerFails(t *testing.T) {
	b := startBroker(t, config{})
	// No close_notify: the agent may have answered, and sent the early
	// data on, in what was lost.
	caller, _, conn, _ := b.orderOnSpareWith(t, []byte("client hello"))
	conn.NetConn().Close()
	_, err := caller.Recv()
	testutil.CheckStatus(t, "the dial whose data connection broke", err, codes.Unavailable, "the agent's data connection failed before it answered the dial")
}

func TestAnAnswerThatIsNotOneFailsTheDialAndResetsTheConnection(t *testing.T) {
	b := startBroker(t, config{})
	// An order without early data, which a lost connection would have
	// ordered again: a broken agent's is not. Its answer says it is
	// 1000 bytes long, where 512 is the most.
	caller, conn, _ := b.orderOnSpare(t)
	if _, err := conn.Write([]byte{0xe8, 0x07}); err != nil {
		t.Fatal(err)
	}
	_, err := caller.Recv()
	testutil.CheckStatus(t, "the dial answered with a 1000-byte answer", err, codes.Unavailable, "the agent's data connection failed before it answered the dial")
	_ = conn.SetReadDeadline(time.Now().Add(testutil.WaitLong))
	if n, err := conn.Read(make([]byte, 1)); err == nil || errors.Is(err, io.EOF) || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("after its bad answer the agent read %d, %v; want a reset", n, err)
	}
}

func TestADataConnectionWhoseAgentNeverAnswersIsClosedAfterTheDialsTimeout(t *testing.T) {
	b := startBroker(t, config{dialTimeout: 200 * time.Millisecond})
	caller, conn, _ := b.orderOnSpare(t)
	_, err := caller.Recv()
	testutil.CheckStatus(t, "the dial the agent never answered", err, codes.DeadlineExceeded, "")
	// The connection is no spare, and counts against no bound: the broker
	// closes it once the answer is late by wire.EndTimeout.
	_ = conn.SetReadDeadline(time.Now().Add(testutil.WaitLong))
	if n, err := conn.Read(make([]byte, 1)); errors.Is(err, os.ErrDeadlineExceeded) || err == nil {
		t.Fatalf("the agent read %d, %v; want the broker to close the connection", n, err)
	}
}

func TestABindToAnotherAgentsSessionOrAnUnknownOneIsNotFound(t *testing.T) {
	b := startBroker(t, config{})
	a := b.ConnectAgent(t, agentA, "a", "root")
	for name, bind := range map[string]struct{ path, session string }{
		"another agent's session": {agentB, a.Session},
		"an unknown session":      {agentA, "0123456789ab"},
	} {
		t.Run(name, func(t *testing.T) {
			conn := b.DataConn(t, bind.path)
			if err := wire.WriteBind(conn, bind.session); err != nil {
				t.Fatal(err)
			}
			_, err := wire.ReadAccepted(conn)
			testutil.CheckStatus(t, "the bind", err, codes.NotFound, "no registration")
		})
	}
}

func TestOnlyAgentsMayOpenDataConnections(t *testing.T) {
	b := startBroker(t, config{})
	conn := b.DataConn(t, kcpPath)
	if err := wire.WriteBind(conn, "0123456789ab"); err != nil {
		t.Fatal(err)
	}
	_, err := wire.ReadAccepted(conn)
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a caller's data connection: %v, want PermissionDenied", err)
	}
}

func TestADataConnectionThatDoesNotBindIsInvalidArgument(t *testing.T) {
	b := startBroker(t, config{})
	conn := b.DataConn(t, agentA)
	// A data frame where the bind belongs.
	if _, err := conn.Write([]byte{3, 0x12, 1, 'x'}); err != nil {
		t.Fatal(err)
	}
	if _, err := wire.ReadAccepted(conn); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("data before the bind: %v, want InvalidArgument", err)
	}
}

func TestABindOverItsBoundIsInvalidArgument(t *testing.T) {
	b := startBroker(t, config{})
	conn := b.DataConn(t, agentA)
	if err := wire.WriteBind(conn, strings.Repeat("0", 200)); err != nil {
		t.Fatal(err)
	}
	_, err := wire.ReadAccepted(conn)
	testutil.CheckStatus(t, "a 200-byte session", err, codes.InvalidArgument, "at most 128 may be")
}

func TestABindThatNeverCompletesCountsAsASpareUntilTheDrainRefusesIt(t *testing.T) {
	b := startBroker(t, config{maxSparesPerPeer: 1})
	a := b.ConnectAgent(t, agentA, "a", "root")
	// The first bytes of a bind, and never the rest.
	slow := b.DataConn(t, agentA)
	if _, err := slow.Write([]byte{14, 0x0a}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the unfinished bind to count as a spare", func() bool { return b.agents.spares.Held(brokertest.ID(agentA)) == 1 })
	next := b.DataConn(t, agentA)
	if err := wire.WriteBind(next, a.Session); err != nil {
		t.Fatal(err)
	}
	_, err := wire.ReadAccepted(next)
	testutil.CheckStatus(t, "a spare beside the unfinished bind", err, codes.ResourceExhausted, "spare_data_connections_per_peer")
	b.Drain()
	_ = slow.SetReadDeadline(time.Now().Add(testutil.WaitLong))
	_, err = wire.ReadAccepted(slow)
	testutil.CheckStatus(t, "the unfinished bind at the drain", err, codes.Unavailable, "the broker is shutting down")
	testutil.Eventually(t, "no spare to count", func() bool { return b.agents.spares.TotalHeld() == 0 })
}

func TestAnAgentThatSpeaksOnAnIdleDataConnectionLosesIt(t *testing.T) {
	b := startBroker(t, config{})
	a := b.ConnectAgent(t, agentA, "a", "root")
	conn := a.DataSpare(t, brokerID)
	waitForCarrier(t, b, agentA)
	// An answer no order asked for.
	if err := wire.WriteAnswer(conn, nil); err != nil {
		t.Fatal(err)
	}
	if n, err := conn.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("the agent read %d, %v; want its connection closed", n, err)
	}
	testutil.Eventually(t, "no spare to count", func() bool { return b.agents.spares.TotalHeld() == 0 })
}

func TestSparesOverTheirBoundAreResourceExhaustedAndFreedWhenUsed(t *testing.T) {
	b := startBroker(t, config{maxSparesPerPeer: 2})
	a := b.ConnectAgent(t, agentA, "a", "team-a")
	a.DataSpare(t, brokerID)
	a.DataSpare(t, brokerID)
	third := b.DataConn(t, agentA)
	if err := wire.WriteBind(third, a.Session); err != nil {
		t.Fatal(err)
	}
	if _, err := wire.ReadAccepted(third); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a third spare: %v, want ResourceExhausted", err)
	}
	// Another peer's spares are its own.
	b.ConnectAgent(t, agentB, "b", "root").DataSpare(t, brokerID)
	testutil.Eventually(t, "agent B's spare to count apart", func() bool { return b.agents.spares.Held(brokertest.ID(agentB)) == 1 })
	// A spare that carries a dial is no longer one: a new spare fits.
	b.StartDial(t, kcpPath, brokertest.Target("team-a"))
	testutil.Eventually(t, "a spare of A's to carry the dial", func() bool { return b.agents.spares.Held(brokertest.ID(agentA)) == 1 })
	a.DataSpare(t, brokerID)
}

func TestIdleDataConnectionsAreClosedWhenTheBrokerDrains(t *testing.T) {
	b := startBroker(t, config{})
	a := b.ConnectAgent(t, agentA, "a", "root")
	spare := a.DataSpare(t, brokerID)
	waitForCarrier(t, b, agentA)
	b.Drain()
	if n, err := spare.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("an idle data connection at the drain read %d, %v; want a close_notify", n, err)
	}
	testutil.Eventually(t, "no spare to count", func() bool { return b.agents.spares.TotalHeld() == 0 })
	// And a new one is refused at once.
	conn := b.DataConn(t, agentA)
	if err := wire.WriteBind(conn, a.Session); err != nil {
		t.Fatal(err)
	}
	_, err := wire.ReadAccepted(conn)
	testutil.CheckStatus(t, "a spare after the drain", err, codes.Unavailable, "the broker is shutting down")
}

func TestIdleDataConnectionsAreClosedWhenTheirRegistrationEnds(t *testing.T) {
	b := startBroker(t, config{})
	a := b.ConnectAgent(t, agentA, "a", "root")
	spare := a.DataSpare(t, brokerID)
	waitForCarrier(t, b, agentA)
	if err := a.Control.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if n, err := spare.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("an idle data connection of an ended registration read %d, %v; want a close_notify", n, err)
	}
}

func TestAnAgentsEndIsTheCallersUnavailableWithItsMessage(t *testing.T) {
	b := startBroker(t, config{})
	caller, _, _, leg := b.establishData(t)
	if err := leg.End(status.Error(codes.Unavailable, "reading from target 10.0.0.7:8443: connection reset by peer")); err != nil {
		t.Fatal(err)
	}
	// The caller hears why, without the address behind the tunnel.
	_, err := caller.Recv()
	testutil.CheckStatus(t, "the Dial after the agent's end", err, codes.Unavailable, "reading from target <address>: connection reset by peer")
	if !leg.Finish() {
		t.Fatal("the data connection is not idle after the end exchange")
	}
}

func TestAFrameTheProtocolDoesNotAllowFromTheAgentIsUnavailableAndResetsTheConnection(t *testing.T) {
	b := startBroker(t, config{})
	caller, _, conn, _ := b.establishData(t)
	// Field 6, a tag no frame has.
	if _, err := conn.Write([]byte{6<<3 | 2, 1, 'x'}); err != nil {
		t.Fatal(err)
	}
	_, err := caller.Recv()
	testutil.CheckStatus(t, "the Dial", err, codes.Unavailable, "tunnel lost on the agent's side")
	if n, err := conn.Read(make([]byte, 1)); n != 0 || err == nil || errors.Is(err, io.EOF) {
		t.Fatalf("after its protocol error the agent read %d, %v; want a reset", n, err)
	}
}

func TestADataConnectionThatEndsMidTunnelIsAFailureNotAHalfClose(t *testing.T) {
	b := startBroker(t, config{})
	caller, _, conn, _ := b.establishData(t)
	// The agent's socket closes under its TLS: no end.
	conn.NetConn().Close()
	msg, err := caller.Recv()
	if msg.GetCloseWrite() != nil {
		t.Fatal("the caller was told the agent half-closed")
	}
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("the Dial ended with %v, %v; want Unavailable", msg, err)
	}
}

func TestAnAgentThatDoesNotAnswerTheBrokersEndIsReset(t *testing.T) {
	b := startBroker(t, config{})
	_, cancel, conn, leg := b.establishData(t)
	cancel()
	if _, err := leg.Read(make([]byte, 1)); status.Code(err) != codes.Canceled {
		t.Fatalf("the agent read %v, want the broker's end with Canceled", err)
	}
	// No end from the agent: after wire.EndTimeout the broker resets the
	// connection rather than keep it for another tunnel.
	n, err := conn.Read(make([]byte, 1))
	if n != 0 || err == nil || errors.Is(err, io.EOF) {
		t.Fatalf("after the broker's end the agent read %d, %v; want a reset", n, err)
	}
	testutil.Eventually(t, "no spare to count", func() bool { return b.agents.spares.TotalHeld() == 0 })
}

func TestAnAgentsBytesRightAfterItsAnswerReachTheCaller(t *testing.T) {
	b := startBroker(t, config{})
	caller, conn, _ := b.orderOnSpare(t)
	// The answer and the target's first bytes at once, as a server that
	// speaks first would have them.
	if err := wire.WriteAnswer(conn, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(wire.AppendData(nil, []byte("220 ready"))); err != nil {
		t.Fatal(err)
	}
	established(t, caller)
	if msg, err := caller.Recv(); err != nil || !bytes.Equal(msg.GetData(), []byte("220 ready")) {
		t.Fatalf("caller got %v, %v; want the agent's first bytes", msg, err)
	}
}

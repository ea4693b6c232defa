package agent

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// spare opens a data connection as path and reads the broker's accept.
func (b *broker) spare(t *testing.T, path string) *tls.Conn {
	t.Helper()
	return brokertest.Accepted(t, b.DataConn(t, path), brokerID)
}

// openData opens a data connection as path for dialID and returns it with
// the broker's answer.
func (b *broker) openData(t *testing.T, path string, dialID uint64) (*tls.Conn, error) {
	t.Helper()
	conn := b.spare(t, path)
	if err := wire.WriteOpen(conn, dialID); err != nil {
		t.Fatal(err)
	}
	return conn, wire.ReadOpenResult(conn)
}

// readFull reads exactly len(want) bytes from r and compares them.
func readFull(t *testing.T, r io.Reader, want string) {
	t.Helper()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(r, got); err != nil || string(got) != want {
		t.Fatalf("read %q, %v; want %q", got, err, want)
	}
}

func TestRegisteredSaysTheBrokerTakesDataConnections(t *testing.T) {
	b := startBroker(t, config{})
	ctx, _ := brokertest.StreamContext(t)
	control, err := tunnelv1.NewAgentServiceClient(b.Conn(t, agentA)).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := control.Send(register("root")); err != nil {
		t.Fatal(err)
	}
	msg, err := control.Recv()
	if err != nil || !msg.GetRegistered().GetDataConnections() {
		t.Fatalf("registration answered %v, %v; want registered with data_connections", msg, err)
	}
}

func TestADataConnectionCarriesItsDialsTunnelBothWays(t *testing.T) {
	b := startBroker(t, config{})
	caller, _, _, leg := b.establishData(t)

	// Up: the caller's frames arrive as data frames, and its half-close as
	// a close_write.
	if err := caller.Send(brokertest.DataUp([]byte("hello "))); err != nil {
		t.Fatal(err)
	}
	if err := caller.Send(brokertest.DataUp([]byte("agent"))); err != nil {
		t.Fatal(err)
	}
	readFull(t, leg, "hello agent")
	if err := caller.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if n, err := leg.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("after the caller's half-close the agent read %d, %v; want EOF", n, err)
	}

	// Down: data frames become the caller's, and the agent's half-close
	// its close_write; then the Dial ends OK, and the broker's end says so.
	if _, err := leg.Write([]byte("hello kcp")); err != nil {
		t.Fatal(err)
	}
	var got []byte
	for len(got) < len("hello kcp") {
		msg, err := caller.Recv()
		if err != nil {
			t.Fatalf("caller: %v after %q", err, got)
		}
		got = append(got, msg.GetData()...)
	}
	if string(got) != "hello kcp" {
		t.Fatalf("caller read %q", got)
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

func TestAnAgentsBytesRightAfterItsOpenReachTheCaller(t *testing.T) {
	b := startBroker(t, config{})
	caller, _, order := b.pendingDial(t)
	conn := b.spare(t, agentA)
	// The open and the target's first bytes at once, as a server that
	// speaks first would have them.
	if err := wire.WriteOpen(conn, order.GetDialId()); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(wire.AppendData(nil, []byte("220 ready"))); err != nil {
		t.Fatal(err)
	}
	if err := wire.ReadOpenResult(conn); err != nil {
		t.Fatal(err)
	}
	if msg, err := caller.Recv(); err != nil || msg.GetEstablished() == nil {
		t.Fatalf("caller got %v, %v; want established", msg, err)
	}
	if msg, err := caller.Recv(); err != nil || string(msg.GetData()) != "220 ready" {
		t.Fatalf("caller got %v, %v; want the agent's first bytes", msg, err)
	}
}

func TestADataConnectionCarriesOneTunnelAfterAnother(t *testing.T) {
	b := startBroker(t, config{})
	a := b.ConnectAgent(t, agentA, "a", "root")
	conn := b.spare(t, agentA)
	for i := range 3 {
		target := brokertest.Target("root")
		caller, cancel := b.StartDial(t, kcpPath, target)
		leg := openOn(t, conn, a.Order(t, target).GetDialId())
		if msg, err := caller.Recv(); err != nil || msg.GetEstablished() == nil {
			t.Fatalf("tunnel %d: caller got %v, %v; want established", i, msg, err)
		}
		msg := fmt.Sprintf("hello %d", i)
		if err := caller.Send(brokertest.DataUp([]byte(msg))); err != nil {
			t.Fatal(err)
		}
		readFull(t, leg, msg)
		// kcp goes away: the broker's end says so, and the exchange
		// leaves the connection idle for the next open.
		cancel()
		if _, err := leg.Read(make([]byte, 1)); status.Code(err) != codes.Canceled {
			t.Fatalf("tunnel %d: the agent read %v, want the broker's end with Canceled", i, err)
		}
		if !leg.Finish() {
			t.Fatalf("tunnel %d: the data connection is not idle after the end exchange", i)
		}
		testutil.Eventually(t, "the idle connection to count as a spare", func() bool { return b.agents.spares.Held(brokertest.ID(agentA)) == 1 })
	}
}

// openOn opens dial dialID on conn, an idle data connection, and returns
// the agent's leg of the tunnel.
func openOn(t *testing.T, conn *tls.Conn, dialID uint64) *wire.Leg {
	t.Helper()
	if err := wire.WriteOpen(conn, dialID); err != nil {
		t.Fatal(err)
	}
	if err := wire.ReadOpenResult(conn); err != nil {
		t.Fatalf("the open of dial %d: %v", dialID, err)
	}
	return wire.NewLeg(conn)
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

func TestADataConnectionForADialNotPendingIsNotFound(t *testing.T) {
	b := startBroker(t, config{})
	b.ConnectAgent(t, agentA, "a", "root")
	_, err := b.openData(t, agentA, 12345)
	if status.Code(err) != codes.NotFound {
		t.Fatalf("open of an unknown dial: %v, want NotFound", err)
	}
}

func TestAnAgentStillWritingWhenItsOpenIsRefusedReadsWhy(t *testing.T) {
	b := startBroker(t, config{})
	b.ConnectAgent(t, agentA, "a", "root")
	conn := b.spare(t, agentA)
	// The agent sends its target's first bytes right behind the open,
	// without waiting for the answer.
	if err := wire.WriteOpen(conn, 12345); err != nil {
		t.Fatal(err)
	}
	bytesFromTarget := bytes.Repeat([]byte("x"), 16<<10)
	if _, err := conn.Write(bytesFromTarget); err != nil {
		t.Fatal(err)
	}
	// Had the broker closed the socket with them unread, it would have
	// sent a reset by now, which fails the agent's next write.
	time.Sleep(200 * time.Millisecond)
	if _, err := conn.Write(bytesFromTarget[:1024]); err != nil {
		t.Fatalf("the agent's write after the refusal: %v; want the broker to read and drop it", err)
	}
	if err := wire.ReadOpenResult(conn); status.Code(err) != codes.NotFound {
		t.Fatalf("open of an unknown dial: %v, want NotFound", err)
	}
}

func TestADataConnectionCannotClaimAnotherAgentsDial(t *testing.T) {
	b := startBroker(t, config{})
	caller, _, order := b.pendingDial(t)
	if _, err := b.openData(t, agentB, order.GetDialId()); status.Code(err) != codes.NotFound {
		t.Fatalf("agent B opening agent A's dial: %v, want NotFound", err)
	}
	// The dial is still agent A's.
	if _, err := b.openData(t, agentA, order.GetDialId()); err != nil {
		t.Fatalf("agent A's own open after B's: %v", err)
	}
	if msg, err := caller.Recv(); err != nil || msg.GetEstablished() == nil {
		t.Fatalf("caller got %v, %v; want established", msg, err)
	}
}

func TestOnlyAgentsMayOpenDataConnections(t *testing.T) {
	b := startBroker(t, config{})
	conn := b.DataConn(t, kcpPath)
	_, err := wire.ReadAccepted(conn)
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a caller's data connection: %v, want PermissionDenied", err)
	}
}

func TestADataConnectionThatDoesNotOpenIsInvalidArgument(t *testing.T) {
	b := startBroker(t, config{})
	conn := b.spare(t, agentA)
	// A data frame where the open belongs.
	if _, err := conn.Write([]byte{3, 0x12, 1, 'x'}); err != nil {
		t.Fatal(err)
	}
	if err := wire.ReadOpenResult(conn); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("data before the open: %v, want InvalidArgument", err)
	}
}

func TestSparesOverTheirBoundAreResourceExhaustedAndFreedWhenUsed(t *testing.T) {
	b := startBroker(t, config{maxSparesPerPeer: 2})
	first := b.spare(t, agentA)
	b.spare(t, agentA)
	third := b.DataConn(t, agentA)
	if _, err := wire.ReadAccepted(third); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a third spare: %v, want ResourceExhausted", err)
	}
	// Another peer's spares are its own.
	b.spare(t, agentB)
	testutil.Eventually(t, "agent B's spare is not counted", func() bool { return b.agents.spares.Held(brokertest.ID(agentB)) == 1 })
	// A spare that names its dial (here, one not pending) is no longer
	// one: a new spare fits again.
	if err := wire.WriteOpen(first, 1); err != nil {
		t.Fatal(err)
	}
	if err := wire.ReadOpenResult(first); status.Code(err) != codes.NotFound {
		t.Fatalf("open of an unknown dial: %v", err)
	}
	testutil.Eventually(t, "the used spare is not counted", func() bool { return b.agents.spares.Held(brokertest.ID(agentA)) == 1 })
	b.spare(t, agentA)
	testutil.Eventually(t, "the new spare is counted", func() bool { return b.agents.spares.Held(brokertest.ID(agentA)) == 2 })
}

func TestSparesHearUnavailableWhenTheBrokerDrains(t *testing.T) {
	b := startBroker(t, config{})
	spare := b.spare(t, agentA)
	testutil.Eventually(t, "the spare is not counted", func() bool { return b.agents.spares.Held(brokertest.ID(agentA)) == 1 })
	b.Drain()
	testutil.CheckStatus(t, "a spare at the drain", wire.ReadOpenResult(spare), codes.Unavailable, "the broker is shutting down")
	testutil.Eventually(t, "the spare is still counted after the drain", func() bool { return b.agents.spares.TotalHeld() == 0 })
	// And a new spare is refused at once.
	_, err := wire.ReadAccepted(b.DataConn(t, agentA))
	testutil.CheckStatus(t, "a spare after the drain", err, codes.Unavailable, "the broker is shutting down")
}

// pendingDial registers agent A for root and dials root as kcp: the
// caller's stream, waiting, and the order agent A got for it.
func (b *broker) pendingDial(t *testing.T) (tunnelv1.DialService_DialClient, context.CancelFunc, *tunnelv1.DialOrder) {
	t.Helper()
	a := b.ConnectAgent(t, agentA, "a", "root")
	target := brokertest.Target("root")
	caller, cancel := b.StartDial(t, kcpPath, target)
	return caller, cancel, a.Order(t, target)
}

// establishData is a tunnel whose agent leg is a data connection: the
// caller's stream, the data connection and the agent's leg on it.
func (b *broker) establishData(t *testing.T) (tunnelv1.DialService_DialClient, context.CancelFunc, *tls.Conn, *wire.Leg) {
	t.Helper()
	caller, cancel, order := b.pendingDial(t)
	conn, err := b.openData(t, agentA, order.GetDialId())
	if err != nil {
		t.Fatal(err)
	}
	if msg, err := caller.Recv(); err != nil || msg.GetEstablished() == nil {
		t.Fatalf("caller got %v, %v; want established", msg, err)
	}
	return caller, cancel, conn, wire.NewLeg(conn)
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

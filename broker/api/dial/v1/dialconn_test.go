package dial

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// These tests play kcpplugin on dial connections (docs/protocol.md §3.6) by
// hand, with package wire's messages, and the agent on gRPC streams.

// spareDial opens a dial connection as path and reads the broker's accept.
// Its reads and writes fail rather than hang past testutil.WaitLong.
func (b *broker) spareDial(t *testing.T, path string) *tls.Conn {
	t.Helper()
	conn := b.DialConn(t, path)
	_ = conn.SetDeadline(time.Now().Add(testutil.WaitLong))
	return brokertest.Accepted(t, conn, brokerID)
}

// writeDial writes a dial of target with earlyData on conn, and then, in
// the same write, the caller's first bytes as a data frame.
func writeDial(t *testing.T, conn *tls.Conn, target *tunnelv1.Target, earlyData []byte, then string) {
	t.Helper()
	msg, err := wire.AppendDial(nil, target, earlyData)
	if err != nil {
		t.Fatal(err)
	}
	if then != "" {
		msg = wire.AppendData(msg, []byte(then))
	}
	if _, err := conn.Write(msg); err != nil {
		t.Fatal(err)
	}
}

// connDialStatus dials target as caller on a new spare and returns the
// broker's answer, which must be a failure.
func (b *broker) connDialStatus(t *testing.T, caller string, target *tunnelv1.Target, earlyData []byte) error {
	t.Helper()
	conn := b.spareDial(t, caller)
	writeDial(t, conn, target, earlyData, "")
	id, err := wire.ReadDialResult(conn)
	if err == nil {
		t.Fatalf("the dial of %v on a dial connection got tunnel %q, want a failure", target, id)
	}
	return err
}

// upstream reads the agent's Tunnel until it has received len(want) bytes
// and compares them.
func upstream(t *testing.T, tun tunnelv1.AgentService_TunnelClient, want string) {
	t.Helper()
	var got []byte
	for len(got) < len(want) {
		msg, err := tun.Recv()
		if err != nil {
			t.Fatalf("agent: %v after %q", err, got)
		}
		got = append(got, msg.GetData()...)
	}
	if string(got) != want {
		t.Fatalf("agent got %q, want %q", got, want)
	}
}

// readFull reads exactly len(want) bytes from r and compares them.
func readFull(t *testing.T, r io.Reader, want string) {
	t.Helper()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(r, got); err != nil || string(got) != want {
		t.Fatalf("read %q, %v; want %q", got, err, want)
	}
}

// establishConn dials the root webhook as kcp on a new dial connection
// (establishOn).
func (b *broker) establishConn(t *testing.T, agent *brokertest.Agent) (*tls.Conn, *wire.Leg, tunnelv1.AgentService_TunnelClient, func()) {
	t.Helper()
	conn := b.spareDial(t, kcpPath)
	leg, tun, cancel := establishOn(t, conn, agent)
	return conn, leg, tun, cancel
}

// establishOn dials the root webhook as kcp on conn, with early data
// "client hello" and the bytes " and more" right after the dial, through
// agent, and checks the broker's answer: the caller's leg of the tunnel,
// and the agent's Tunnel stream.
func establishOn(t *testing.T, conn *tls.Conn, agent *brokertest.Agent) (*wire.Leg, tunnelv1.AgentService_TunnelClient, func()) {
	t.Helper()
	target := brokertest.Target("root")
	writeDial(t, conn, target, []byte("client hello"), " and more")
	order := agent.Order(t, target)
	tun, cancel := agent.Open(t, order.GetDialId())
	id, err := wire.ReadDialResult(conn)
	if want := fmt.Sprintf("%016x", order.GetDialId()); err != nil || id != want {
		t.Fatalf("the dial got %q, %v; want tunnel %q", id, err, want)
	}
	return wire.NewLeg(conn), tun, cancel
}

func TestADialConnectionCarriesItsTunnelBothWays(t *testing.T) {
	logs := &brokertest.LogBuffer{}
	b := startBroker(t, config{log: logs})
	_, leg, tun, _ := b.establishConn(t, b.connectAgent(t, "a", "root"))

	// Up: the early data first, then what followed the dial; the caller's
	// close_write is the agent's.
	upstream(t, tun, "client hello and more")
	if err := leg.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if msg, err := tun.Recv(); err != nil || msg.GetCloseWrite() == nil {
		t.Fatalf("agent got %v, %v; want close_write", msg, err)
	}

	// Down: the agent's frames, and its half-close as a close_write;
	// then the tunnel has ended OK, and the broker says so with its end.
	if err := tun.Send(brokertest.DataDown([]byte("server hello"))); err != nil {
		t.Fatal(err)
	}
	readFull(t, leg, "server hello")
	if err := tun.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if n, err := leg.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("after the agent's half-close the caller read %d, %v; want EOF", n, err)
	}
	if err := leg.AwaitEnd(); err != nil {
		t.Fatalf("the broker ended the tunnel with %v, want OK", err)
	}
	if _, err := tun.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("the agent's Tunnel ended with %v, want OK", err)
	}
	if !leg.Finish() {
		t.Fatal("the connection is not idle after the end exchange")
	}
	audit := auditLine(t, logs)
	want := map[string]any{"caller": brokertest.ID(kcpPath).String(), "cluster": "root", "agent": "a",
		"broker": brokerID, "bytes_up": float64(len("client hello and more")), "bytes_down": float64(len("server hello")), "code": "OK"}
	for k, v := range want {
		if audit[k] != v {
			t.Errorf("audit %s = %v, want %v", k, audit[k], v)
		}
	}
	testutil.Eventually(t, "the tunnel to stop counting", func() bool { return b.dial.Active() == 0 })
}

func TestADialConnectionCarriesOneTunnelAfterAnother(t *testing.T) {
	idle := metrics.ConnectionTunnelsEnded.WithLabelValues("dial_connection", "idle")
	before := promtestutil.ToFloat64(idle)
	b := startBroker(t, config{})
	agent := b.connectAgent(t, "a", "root")
	conn := b.spareDial(t, kcpPath)
	for i := range 3 {
		leg, tun, _ := establishOn(t, conn, agent)
		upstream(t, tun, "client hello and more")
		msg := fmt.Sprintf("answer %d", i)
		if err := tun.Send(brokertest.DataDown([]byte(msg))); err != nil {
			t.Fatal(err)
		}
		readFull(t, leg, msg)
		// The caller closes without a half-close: its end, answered by
		// the broker's, leaves the connection idle for the next dial.
		if !leg.Finish() {
			t.Fatalf("tunnel %d: the connection is not idle after the end exchange", i)
		}
		if _, err := tun.Recv(); status.Code(err) != codes.Canceled {
			t.Fatalf("tunnel %d: the agent's Tunnel ended with %v, want Canceled (the caller went away)", i, err)
		}
		// Idle again, it counts as a spare of its caller.
		testutil.Eventually(t, "the idle connection to count as a spare", func() bool { return b.dial.spares.Held(brokertest.ID(kcpPath)) == 1 })
	}
	// The counter is the process's: a test before this one may still be
	// ending a tunnel.
	if n := promtestutil.ToFloat64(idle) - before; n < 3 {
		t.Errorf("%v tunnels counted as leaving their dial connection idle, want 3", n)
	}
}

// auditLine waits for the first audit line in logs and returns its fields.
func auditLine(t *testing.T, logs *brokertest.LogBuffer) map[string]any {
	t.Helper()
	var audit map[string]any
	testutil.Eventually(t, "the audit line", func() bool {
		for line := range strings.SplitSeq(strings.TrimSpace(logs.String()), "\n") {
			var entry struct {
				Msg   string
				Audit map[string]any
			}
			if json.Unmarshal([]byte(line), &entry) == nil && entry.Msg == AuditMessage {
				audit = entry.Audit
				return true
			}
		}
		return false
	})
	return audit
}

func TestATunnelThatFailsEndsWithTheCallersStatusAndLeavesTheConnectionIdle(t *testing.T) {
	b := startBroker(t, config{})
	agent := b.connectAgent(t, "a", "root")
	conn, leg, _, cancelAgent := b.establishConn(t, agent)
	cancelAgent()
	_, err := leg.Read(make([]byte, 1))
	testutil.CheckStatus(t, "the caller's read after the agent went away", err, codes.Unavailable, "tunnel lost on the agent's side")
	if !leg.Finish() {
		t.Fatal("the connection is not idle after the end exchange")
	}
	// And it carries the next dial.
	leg, tun, _ := establishOn(t, conn, agent)
	upstream(t, tun, "client hello and more")
	leg.Finish()
}

func TestACallerThatDoesNotAnswerTheBrokersEndIsReset(t *testing.T) {
	reset := metrics.ConnectionTunnelsEnded.WithLabelValues("dial_connection", "reset")
	before := promtestutil.ToFloat64(reset)
	b := startBroker(t, config{})
	conn, leg, _, cancelAgent := b.establishConn(t, b.connectAgent(t, "a", "root"))
	cancelAgent()
	if _, err := leg.Read(make([]byte, 1)); status.Code(err) != codes.Unavailable {
		t.Fatalf("the caller read %v, want the broker's end with Unavailable", err)
	}
	// The caller sends no end: after wire.EndTimeout the broker resets the
	// connection rather than keep it for another tunnel.
	start := time.Now()
	n, err := conn.Read(make([]byte, 1))
	if n != 0 || err == nil || errors.Is(err, io.EOF) {
		t.Fatalf("after the broker's end the caller read %d, %v; want a reset", n, err)
	}
	if waited := time.Since(start); waited < wire.EndTimeout/2 {
		t.Fatalf("reset after %v, want about wire.EndTimeout", waited)
	}
	testutil.Eventually(t, "no spare to count", func() bool { return b.dial.spares.TotalHeld() == 0 })
	if n := promtestutil.ToFloat64(reset) - before; n < 1 {
		t.Errorf("%v tunnels counted as resetting their dial connection, want 1", n)
	}
}

func TestAFrameTheProtocolDoesNotAllowIsTheCallersProtocolErrorAndResetsTheConnection(t *testing.T) {
	b := startBroker(t, config{})
	conn, _, tun, _ := b.establishConn(t, b.connectAgent(t, "a", "root"))
	upstream(t, tun, "client hello and more")
	// Field 6, a tag no frame has.
	if _, err := conn.Write([]byte{6<<3 | 2, 1, 'x'}); err != nil {
		t.Fatal(err)
	}
	testutil.CheckStatus(t, "the agent's Tunnel", recvErr(tun), codes.Canceled, "caller broke the protocol")
	n, err := conn.Read(make([]byte, 1))
	if n != 0 || err == nil || errors.Is(err, io.EOF) {
		t.Fatalf("after its protocol error the caller read %d, %v; want a reset", n, err)
	}
}

// recvErr receives from tun until it ends, and returns how.
func recvErr(tun tunnelv1.AgentService_TunnelClient) error {
	for {
		if _, err := tun.Recv(); err != nil {
			return err
		}
	}
}

func TestTheBrokerDropsAtMostEndDrainOfACallersDataBeforeItsEnd(t *testing.T) {
	b := startBroker(t, config{})
	conn, leg, _, cancelAgent := b.establishConn(t, b.connectAgent(t, "a", "root"))
	cancelAgent()
	if _, err := leg.Read(make([]byte, 1)); status.Code(err) != codes.Unavailable {
		t.Fatalf("the caller read %v, want the broker's end with Unavailable", err)
	}
	// A caller that goes on sending without its end: past wire.EndDrain
	// bytes the broker resets the connection. The sockets' buffers take a
	// few MiB before a write notices.
	frame := wire.AppendData(nil, bytes.Repeat([]byte("x"), wire.MaxFrame))
	const most = 64 * wire.EndDrain
	for sent := 0; sent <= most; sent += wire.MaxFrame {
		if _, err := conn.Write(frame); err != nil {
			return // reset, as it should be
		}
	}
	t.Fatalf("the broker took %d bytes after its end without resetting the connection", most)
}

func TestAnIdleDialConnectionOverTheSparesBoundIsResourceExhausted(t *testing.T) {
	b := startBroker(t, config{maxSparesPerPeer: 1})
	agent := b.connectAgent(t, "a", "root")
	conn, leg, _, _ := b.establishConn(t, agent)
	// The connection carries a tunnel, so another spare fits the bound.
	b.spareDial(t, kcpPath)
	testutil.Eventually(t, "the other spare to count", func() bool { return b.dial.spares.Held(brokertest.ID(kcpPath)) == 1 })
	if !leg.Finish() {
		t.Fatal("the connection is not idle after the end exchange")
	}
	// Idle again it is a spare too many: the broker refuses it as it
	// refuses a new one.
	_, err := wire.ReadDialResult(conn)
	testutil.CheckStatus(t, "the idle connection over the bound", err, codes.ResourceExhausted, "spare_dial_connections_per_peer")
}

func TestAnIdleDialConnectionHearsUnavailableWhenTheBrokerDrains(t *testing.T) {
	b := startBroker(t, config{})
	conn, leg, _, _ := b.establishConn(t, b.connectAgent(t, "a", "root"))
	if !leg.Finish() {
		t.Fatal("the connection is not idle after the end exchange")
	}
	testutil.Eventually(t, "the idle connection to count as a spare", func() bool { return b.dial.spares.Held(brokertest.ID(kcpPath)) == 1 })
	b.Drain()
	_, err := wire.ReadDialResult(conn)
	testutil.CheckStatus(t, "an idle connection at the drain", err, codes.Unavailable, "the broker is shutting down")
}

func TestOnlyCallersMayOpenDialConnections(t *testing.T) {
	b := startBroker(t, config{})
	_, err := wire.ReadAccepted(b.DialConn(t, agentPath))
	testutil.CheckStatus(t, "an agent's dial connection", err, codes.PermissionDenied, "spiffe://example.org/agent may not open dial connections")
}

func TestADialConnectionsDialOutsideItsCallersClustersIsPermissionDenied(t *testing.T) {
	b := startBroker(t, config{})
	b.connectAgent(t, "a", "root", "team-a")
	testutil.CheckStatus(t, "shard dialing root", b.connDialStatus(t, shardPath, brokertest.Target("root"), nil),
		codes.PermissionDenied, `spiffe://example.org/shard may not dial logical cluster "root"`)
}

func TestACallerStillWritingWhenItsDialFailsReadsWhy(t *testing.T) {
	b := startBroker(t, config{timeout: 100 * time.Millisecond})
	a := b.connectAgent(t, "silent", "root")
	conn := b.spareDial(t, kcpPath)
	writeDial(t, conn, brokertest.Target("root"), []byte("client hello"), "")
	a.Order(t, brokertest.Target("root")) // the broker has read the dial
	// The caller's request goes on without waiting for the answer, and the
	// broker does not read it while the dial waits.
	request := bytes.Repeat([]byte("x"), 4096)
	if _, err := conn.Write(request); err != nil {
		t.Fatal(err)
	}
	// Past the dial timeout, the broker has refused the dial. Had it
	// closed the socket with the request unread, the socket would have
	// sent a reset, which fails the caller's next write (kcpplugin then
	// reports the write's error, not the refusal it has not read yet).
	time.Sleep(500 * time.Millisecond)
	if _, err := conn.Write(request); err != nil {
		t.Fatalf("the caller's write after the refusal: %v; want the broker to read and drop it", err)
	}
	_, err := wire.ReadDialResult(conn)
	testutil.CheckStatus(t, "dial", err, codes.DeadlineExceeded, "did not connect in time")
	if n, err := conn.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("after the refusal the caller read %d, %v; want the broker's close_notify", n, err)
	}
}

func TestADialConnectionsDialIsCheckedAsADialStreamsTarget(t *testing.T) {
	b := startBroker(t, config{})
	b.connectAgent(t, "a", "root")
	for _, tc := range []struct {
		name      string
		target    *tunnelv1.Target
		earlyData []byte
		message   string
	}{
		{"cluster path", &tunnelv1.Target{Cluster: "root:org", Namespace: "default", Service: "webhook", Port: 443}, nil, `logical cluster "root:org" is not a valid logical cluster name`},
		{"port zero", &tunnelv1.Target{Cluster: "root", Namespace: "default", Service: "webhook"}, nil, "port 0 is outside 1-65535"},
		{"early data over its bound", brokertest.Target("root"), bytes.Repeat([]byte("x"), wire.MaxEarlyData+1), "a dial's early data may be at most 16384 bytes, not 16385"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testutil.CheckStatus(t, "dial", b.connDialStatus(t, kcpPath, tc.target, tc.earlyData), codes.InvalidArgument, tc.message)
		})
	}
	t.Run("not a dial", func(t *testing.T) {
		conn := b.spareDial(t, kcpPath)
		// A data frame where the dial belongs.
		if _, err := conn.Write([]byte{3, 0x12, 1, 'x'}); err != nil {
			t.Fatal(err)
		}
		_, err := wire.ReadDialResult(conn)
		testutil.CheckStatus(t, "data before the dial", err, codes.InvalidArgument, "must name a target")
	})
}

func TestADialConnectionWithoutAnAgentForTheClusterIsUnavailable(t *testing.T) {
	b := startBroker(t, config{})
	b.connectAgent(t, "a", "team-a")
	testutil.CheckStatus(t, "dial", b.connDialStatus(t, kcpPath, brokertest.Target("root"), nil), codes.Unavailable, `no agent serves logical cluster "root"`)
}

func TestADialConnectionsDialTimesOutAsADialStreamsDoes(t *testing.T) {
	b := startBroker(t, config{timeout: 200 * time.Millisecond})
	a := b.connectAgent(t, "silent", "root")
	conn := b.spareDial(t, kcpPath)
	writeDial(t, conn, brokertest.Target("root"), nil, "")
	a.Order(t, brokertest.Target("root")) // and never opened
	_, err := wire.ReadDialResult(conn)
	testutil.CheckStatus(t, "dial", err, codes.DeadlineExceeded, "did not connect in time")
}

func TestADialConnectionsTunnelCountsAgainstItsCaller(t *testing.T) {
	b := startBroker(t, config{maxTunnelsPerCaller: 1})
	a := b.connectAgent(t, "a", "root")
	a.Establish(t, kcpPath, brokertest.Target("root"))
	testutil.CheckStatus(t, "a second tunnel", b.connDialStatus(t, kcpPath, brokertest.Target("root"), nil),
		codes.ResourceExhausted, "spiffe://example.org/kcp already holds 1 tunnels, the most a caller may")
}

func TestSpareDialConnectionsOverTheirBoundAreResourceExhaustedAndFreedWhenUsed(t *testing.T) {
	b := startBroker(t, config{maxSparesPerPeer: 2})
	first := b.spareDial(t, kcpPath)
	b.spareDial(t, kcpPath)
	_, err := wire.ReadAccepted(b.DialConn(t, kcpPath))
	testutil.CheckStatus(t, "a third spare", err, codes.ResourceExhausted, "spare_dial_connections_per_peer")
	// Another caller's spares are its own.
	b.spareDial(t, shardPath)
	testutil.Eventually(t, "the shard's spare to count", func() bool { return b.dial.spares.Held(brokertest.ID(shardPath)) == 1 })
	// A spare that has sent its dial (here, one refused) is no longer
	// one: a new spare fits again.
	writeDial(t, first, &tunnelv1.Target{Cluster: "root"}, nil, "")
	if _, err := wire.ReadDialResult(first); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("an invalid dial: %v, want InvalidArgument", err)
	}
	testutil.Eventually(t, "the used spare to stop counting", func() bool { return b.dial.spares.Held(brokertest.ID(kcpPath)) == 1 })
	b.spareDial(t, kcpPath)
}

func TestSpareDialConnectionsOfAllCallersAreBounded(t *testing.T) {
	b := startBroker(t, config{maxSpares: 1})
	b.spareDial(t, kcpPath)
	_, err := wire.ReadAccepted(b.DialConn(t, shardPath))
	testutil.CheckStatus(t, "another caller's spare", err, codes.ResourceExhausted, "spare_dial_connections")
}

func TestSpareDialConnectionsHearUnavailableWhenTheBrokerDrains(t *testing.T) {
	b := startBroker(t, config{})
	spare := b.spareDial(t, kcpPath)
	testutil.Eventually(t, "the spare to count", func() bool { return b.dial.spares.Held(brokertest.ID(kcpPath)) == 1 })
	b.Drain()
	_, err := wire.ReadDialResult(spare)
	testutil.CheckStatus(t, "a spare at the drain", err, codes.Unavailable, "the broker is shutting down")
	if n, err := spare.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("after its answer the spare read %d, %v; want the broker's close_notify", n, err)
	}
	testutil.Eventually(t, "the spare to stop counting", func() bool { return b.dial.spares.TotalHeld() == 0 })
	// And a new spare is refused at once.
	_, err = wire.ReadAccepted(b.DialConn(t, kcpPath))
	testutil.CheckStatus(t, "a spare after the drain", err, codes.Unavailable, "the broker is shutting down")
}

// A spare that sends its dial a byte at a time holds its place among the
// spares until the dial is whole, and only then is the dial checked: what
// bounds a slow dial is the spares' number.
func TestADialSentSlowlyCountsAsASpareUntilWhole(t *testing.T) {
	b := startBroker(t, config{maxSparesPerPeer: 1})
	conn := b.spareDial(t, kcpPath)
	msg, err := wire.AppendDial(nil, brokertest.Target("root"), []byte("client hello"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range msg[:len(msg)-1] {
		if _, err := conn.Write([]byte{c}); err != nil {
			t.Fatal(err)
		}
	}
	_, err = wire.ReadAccepted(b.DialConn(t, kcpPath))
	testutil.CheckStatus(t, "a spare beside the slow one", err, codes.ResourceExhausted, "spare_dial_connections_per_peer")
	if _, err := conn.Write(msg[len(msg)-1:]); err != nil {
		t.Fatal(err)
	}
	_, err = wire.ReadDialResult(conn)
	testutil.CheckStatus(t, "the slow dial, once whole", err, codes.Unavailable, `no agent serves logical cluster "root"`)
	testutil.Eventually(t, "the spare to stop counting", func() bool { return b.dial.spares.Held(brokertest.ID(kcpPath)) == 0 })
}

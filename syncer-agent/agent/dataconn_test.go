package agent

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// dataAgent is newAgent as the agent binary runs it against a broker that
// accepts data connections: with two spares.
func dataAgent(t *testing.T, p *pki, b *fakeBroker, r lookup.Resolver) *Agent {
	b.dataConnections = true
	a := newAgent(t, p, b, r)
	a.DataCredentials = p.agentDataCredentials()
	a.SpareDataConnections = 2
	return a
}

// establishedOnData runs an agent with spares of a fresh broker that
// accepts data connections, waits for its spares, orders order (dial id 1)
// and returns the broker, the session, the data connection whose open
// arrived (not answered yet) and the target's connection.
func establishedOnData(t *testing.T, order *tunnelv1.DialOrder) (*fakeBroker, *session, *dataLeg, *net.TCPConn) {
	t.Helper()
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	run(t, dataAgent(t, p, b, staticResolver(t, tg.addr())))
	s := b.nextSession(t)
	b.waitForFullPool(t)
	s.order(t, order)
	conn := tg.accept(t)
	leg := b.nextDataLeg(t)
	if leg.dialID != order.GetDialId() {
		t.Fatalf("data connection opened for dial %d, want %d", leg.dialID, order.GetDialId())
	}
	return b, s, leg, conn
}

func TestATunnelGoesOnADataConnectionWhenTheBrokerAcceptsThem(t *testing.T) {
	opened := promtestutil.ToFloat64(tunnelsOpened.WithLabelValues(legDataConnection))
	b, _, leg, conn := establishedOnData(t, dialOrder(1))
	if want := newPKI(t).agentID; leg.peer != want {
		t.Errorf("the data connection's peer is %q, want the agent's SVID %q", leg.peer, want)
	}
	leg.answer(t, nil)

	// Both directions at once, each larger than a TLS record, a read
	// buffer and a frame, each ending with its half-close.
	up, down := randomBytes(t, 300<<10), randomBytes(t, 300<<10)
	errs := make(chan error, 3)
	targetGot, brokerGot := make(chan []byte, 1), make(chan []byte, 1)
	go func() {
		_, err := conn.Write(down)
		if err == nil {
			err = conn.CloseWrite()
		}
		errs <- err
	}()
	go func() {
		b, err := io.ReadAll(conn)
		targetGot <- b
		errs <- err
	}()
	go func() {
		b, err := leg.recvAll() // to the close_write
		brokerGot <- b
		errs <- err
	}()
	for chunk := range slices.Chunk(up, 50<<10) {
		leg.send(t, chunk)
	}
	leg.closeWrite(t)
	for range 3 {
		if err := testutil.Wait(t, "the reads and writes", errs); err != nil {
			t.Fatal(err)
		}
	}
	if got := testutil.Wait(t, "the target's bytes", targetGot); !bytes.Equal(got, up) {
		t.Errorf("the target read %d bytes before EOF, not the %d the broker sent", len(got), len(up))
	}
	if got := testutil.Wait(t, "the broker's bytes", brokerGot); !bytes.Equal(got, down) {
		t.Errorf("the broker read %d bytes before the close_write, not the %d the target sent", len(got), len(down))
	}
	if err := leg.finish(t, nil); err != nil {
		t.Errorf("the agent ended the tunnel with %v, want OK", err)
	}
	b.noTunnel(t)
	if got := promtestutil.ToFloat64(tunnelsOpened.WithLabelValues(legDataConnection)) - opened; got != 1 {
		t.Errorf("tunnels_opened_total{leg=data_connection} grew by %v, want 1", got)
	}
}

// reusingAgent runs an agent with one spare data connection of a fresh
// broker, on a fake clock that only the test moves: until it does, the
// pool opens no spare to replace one taken (wire.ReplaceAfterTake never
// passes), so a dial rides the connection a tunnel gave back, or a Tunnel
// stream. It returns once the spare is in the pool.
func reusingAgent(t *testing.T) (*fakeBroker, *session, *target, *clocktesting.FakeClock) {
	t.Helper()
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	a := dataAgent(t, p, b, staticResolver(t, tg.addr()))
	a.SpareDataConnections = 1
	clk := fakeClock(a)
	run(t, a)
	s := b.nextSession(t)
	b.waitForPoolOf(t, 1)
	return b, s, tg, clk
}

// dialOnData orders dial id, which must go on a data connection, and
// returns the broker's side of its tunnel, answered OK, and the target's
// connection.
func dialOnData(t *testing.T, b *fakeBroker, s *session, tg *target, id uint64) (*dataLeg, *net.TCPConn) {
	t.Helper()
	s.order(t, dialOrder(id))
	conn := tg.accept(t)
	leg := b.nextDataLeg(t)
	if leg.dialID != id {
		t.Fatalf("data connection opened for dial %d, want %d", leg.dialID, id)
	}
	leg.answer(t, nil)
	return leg, conn
}

// resetTarget resets the target's connection, once the agent has read
// the broker's OK: a byte from the broker has reached the target. Before
// it the agent aborts the tunnel, as it always has.
func resetTarget(t *testing.T, leg *dataLeg, conn *net.TCPConn) {
	t.Helper()
	leg.send(t, []byte("!"))
	if _, err := io.ReadFull(conn, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	if err := conn.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	conn.Close()
}

// carryCleanly carries a request to the target and its response back on
// leg's tunnel, each followed by its half-close, and ends the tunnel with
// OK both ways, as a webhook call does.
func carryCleanly(t *testing.T, leg *dataLeg, conn *net.TCPConn, request, response string) {
	t.Helper()
	leg.send(t, []byte(request))
	leg.closeWrite(t)
	if got, err := io.ReadAll(conn); err != nil || string(got) != request {
		t.Fatalf("the target read %q, %v; want %q, then EOF", got, err, request)
	}
	if _, err := conn.Write([]byte(response)); err != nil {
		t.Fatal(err)
	}
	if err := conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if got, err := leg.recvAll(); err != nil || string(got) != response {
		t.Fatalf("the broker read %q, %v; want %q, then the close_write", got, err, response)
	}
	if err := leg.finish(t, nil); err != nil {
		t.Fatalf("after the broker's OK end the agent sent its end with %v, want OK", err)
	}
}

// tunnelsEnded waits until the agent's tunnels in flight are back to n. A
// tunnel on a data connection counts until it has given its connection
// back to the pool, where the next dial then finds it: a dial ordered
// before would go on a Tunnel stream.
func tunnelsEnded(t *testing.T, n float64) {
	t.Helper()
	testutil.Eventually(t, "the tunnel to give its data connection back", func() bool { return promtestutil.ToFloat64(tunnelsOpen) == n })
}

// agentSocket is the inode of the agent's socket of conn, the target's
// side of a connection from the agent, while it is established; "" where
// there is no /proc/self/net/tcp to find it in.
func agentSocket(t *testing.T, conn *net.TCPConn) string {
	t.Helper()
	table, err := os.ReadFile("/proc/self/net/tcp")
	if err != nil {
		t.Logf("the agent's sockets cannot be told apart here: %v", err)
		return ""
	}
	local, remote := procAddr(conn.RemoteAddr()), procAddr(conn.LocalAddr())
	for line := range strings.Lines(string(table)) {
		f := strings.Fields(line)
		if len(f) > 9 && f[1] == local && f[2] == remote {
			return f[9]
		}
	}
	t.Fatalf("no socket from %s to %s in /proc/self/net/tcp", local, remote)
	return ""
}

// procAddr is addr as /proc/net/tcp spells it.
func procAddr(addr net.Addr) string {
	a := addr.(*net.TCPAddr)
	return fmt.Sprintf("%08X:%04X", binary.NativeEndian.Uint32(a.IP.To4()), a.Port)
}

// socketClosed checks that the agent has closed its socket inode (from
// agentSocket) by now. Once both sides of a TCP connection have
// half-closed nothing on the wire says that one of them closed its
// socket too, so the check looks at the agent's file descriptors.
func socketClosed(t *testing.T, inode string) {
	t.Helper()
	if inode == "" {
		return
	}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		if link, _ := os.Readlink("/proc/self/fd/" + fd.Name()); link == "socket:["+inode+"]" {
			t.Fatalf("the agent's socket to the target is open still, as fd %s", fd.Name())
		}
	}
}

func TestDialsInARowRideTheSameDataConnection(t *testing.T) {
	b, s, tg, _ := reusingAgent(t)
	inFlight := promtestutil.ToFloat64(tunnelsOpen)
	var first int32
	for id := uint64(1); id <= 3; id++ {
		leg, conn := dialOnData(t, b, s, tg, id)
		socket := agentSocket(t, conn)
		if id == 1 {
			first = leg.connNo
		} else if leg.connNo != first {
			t.Errorf("dial %d rode data connection %d, want %d, the one the tunnel before gave back", id, leg.connNo, first)
		}
		carryCleanly(t, leg, conn, fmt.Sprintf("request %d", id), fmt.Sprintf("response %d", id))
		// The agent closes the target before it sends its end.
		socketClosed(t, socket)
		tunnelsEnded(t, inFlight)
	}
	b.noTunnel(t)
	if n := b.dataAccepted.Load(); n != 1 {
		t.Errorf("the broker took %d data connections for three dials in a row, want 1", n)
	}
}

func TestABrokersFailedEndResetsTheTargetAndTheConnectionCarriesTheNextDial(t *testing.T) {
	b, s, tg, _ := reusingAgent(t)
	inFlight := promtestutil.ToFloat64(tunnelsOpen)
	leg, conn := dialOnData(t, b, s, tg, 1)
	leg.send(t, []byte("half a request"))
	got := make([]byte, len("half a request"))
	if _, err := io.ReadFull(conn, got); err != nil {
		t.Fatal(err)
	}

	// kcp went away: the broker ends the tunnel with Canceled.
	if err := leg.finish(t, status.Error(codes.Canceled, "the caller went away")); err != nil {
		t.Errorf("the agent answered the broker's end with %v, want OK", err)
	}
	if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read after the broker's Canceled end: %v, want a connection reset", err)
	}
	tunnelsEnded(t, inFlight)

	next, conn2 := dialOnData(t, b, s, tg, 2)
	if next.connNo != leg.connNo {
		t.Errorf("the next dial rode data connection %d, want %d, the one the failed tunnel gave back", next.connNo, leg.connNo)
	}
	carryCleanly(t, next, conn2, "request", "response")
}

func TestATargetThatResetsEndsTheTunnelWithUnavailableAndTheConnectionCarriesTheNextDial(t *testing.T) {
	b, s, tg, _ := reusingAgent(t)
	inFlight := promtestutil.ToFloat64(tunnelsOpen)
	leg, conn := dialOnData(t, b, s, tg, 1)

	resetTarget(t, leg, conn)
	testutil.CheckStatus(t, "the agent's end", leg.awaitEnd(t), codes.Unavailable, "reading from target: connection reset by peer")
	// The connection is idle once the broker's end answers the agent's.
	leg.end(t, status.Error(codes.Aborted, "the agent's leg failed"))
	leg.reused()
	tunnelsEnded(t, inFlight)

	next, conn2 := dialOnData(t, b, s, tg, 2)
	if next.connNo != leg.connNo {
		t.Errorf("the next dial rode data connection %d, want %d, the one the failed tunnel gave back", next.connNo, leg.connNo)
	}
	carryCleanly(t, next, conn2, "request", "response")
}

func TestABrokerThatNeverAnswersTheAgentsEndLosesTheConnection(t *testing.T) {
	b, s, tg, clk := reusingAgent(t)
	leg, conn := dialOnData(t, b, s, tg, 1)
	resetTarget(t, leg, conn)
	testutil.CheckStatus(t, "the agent's end", leg.awaitEnd(t), codes.Unavailable, "connection reset by peer")

	// The broker sends no end: the agent waits for it wire.EndTimeout,
	// then resets the connection.
	sent := time.Now()
	err := leg.connEnd()
	if waited := time.Since(sent); !errors.Is(err, syscall.ECONNRESET) || waited < wire.EndTimeout/2 {
		t.Errorf("the connection ended %v after the agent's end with %v, want a reset after about %v", waited, err, wire.EndTimeout)
	}

	// The spare's replacement, once it is due, is a new connection.
	waitUntilWaiting(t, clk, "the replacement of the spare taken")
	clk.Step(time.Second)
	b.waitForPoolOf(t, 1)
	next, conn2 := dialOnData(t, b, s, tg, 2)
	if next.connNo == leg.connNo {
		t.Errorf("the next dial rode data connection %d, the one the agent reset", next.connNo)
	}
	carryCleanly(t, next, conn2, "request", "response")
	if n := b.dataAccepted.Load(); n != 2 {
		t.Errorf("the broker took %d data connections, want 2", n)
	}
}

func TestAFrameTheProtocolDoesNotAllowFailsTheTunnelAndItsConnection(t *testing.T) {
	b, s, tg, _ := reusingAgent(t)
	leg, conn := dialOnData(t, b, s, tg, 1)

	// Field 1 of a ConnFrame: no frame has it.
	if _, err := leg.conn.Write([]byte{1<<3 | 2, 0}); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read after the broker's bad frame: %v, want a connection reset", err)
	}
	if err := leg.connEnd(); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the data connection ended with %v, want a reset", err)
	}
	if n := b.spares.Load(); n != 0 {
		t.Errorf("the agent holds %d spares, want none: the connection must not carry another tunnel", n)
	}
}

func TestAnAgentThatStopsMidEndExchangeLeavesNothingBehind(t *testing.T) {
	leaks := goleak.IgnoreCurrent()
	// Runs last, once the broker, the target and the agent are stopped.
	t.Cleanup(func() { goleak.VerifyNone(t, leaks) })
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	stop := run(t, dataAgent(t, p, b, staticResolver(t, tg.addr())))
	s := b.nextSession(t)
	b.waitForFullPool(t)
	leg, conn := dialOnData(t, b, s, tg, 1)
	resetTarget(t, leg, conn)
	testutil.CheckStatus(t, "the agent's end", leg.awaitEnd(t), codes.Unavailable, "connection reset by peer")

	// The agent waits for the broker's end, which does not come. Its
	// grace over, it resets the connection, long before its wait for the
	// end would have.
	stopped := time.Now()
	stop()
	if err := leg.connEnd(); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the data connection ended with %v, want a reset", err)
	}
	if took := time.Since(stopped); took >= wire.EndTimeout/2 {
		t.Errorf("the agent took %v to stop, want it to reset the tunnel at the end of its grace", took)
	}
	testutil.Eventually(t, "the spare left to be closed", func() bool { return b.spares.Load() == 0 })
}

// TestABrokerThatDoesNotAcceptDataConnectionsGetsTunnelStreams: without
// every condition for data connections, dials go on Tunnel streams.
func TestABrokerThatDoesNotAcceptDataConnectionsGetsTunnelStreams(t *testing.T) {
	for name, setup := range map[string]func(*pki, *fakeBroker, *Agent){
		"the broker does not set data_connections": func(_ *pki, b *fakeBroker, _ *Agent) { b.dataConnections = false },
		"the agent keeps no spares":                func(_ *pki, _ *fakeBroker, a *Agent) { a.SpareDataConnections = 0 },
		"the agent has no data credentials":        func(_ *pki, _ *fakeBroker, a *Agent) { a.DataCredentials = nil },
		// The broker's handshake picks h2: the agent gives up on data
		// connections for the session.
		"the handshake does not pick the data protocol": func(p *pki, _ *fakeBroker, a *Agent) {
			a.DataCredentials = wire.CoalesceWrites(p.agentCredentials())
		},
	} {
		t.Run(name, func(t *testing.T) {
			p := newPKI(t)
			b := startBroker(t, p)
			tg := listenTarget(t)
			a := dataAgent(t, p, b, staticResolver(t, tg.addr()))
			setup(p, b, a)
			logged := captureLog(t, a)
			stop := run(t, a)
			s := b.nextSession(t)

			s.order(t, dialOrder(1))
			conn := tg.accept(t)
			tu := b.nextTunnel(t)
			if tu.open.GetDialId() != 1 {
				t.Errorf("Tunnel opened for dial %d, want 1", tu.open.GetDialId())
			}
			if _, err := conn.Write([]byte("on a stream")); err != nil {
				t.Fatal(err)
			}
			if got, err := tu.recvN(len("on a stream")); err != nil || string(got) != "on a stream" {
				t.Errorf("broker read %q, %v", got, err)
			}
			stop()
			if n := b.dataAccepted.Load(); n != 0 {
				t.Errorf("the agent opened %d data connections, want none", n)
			}
			if name == "the handshake does not pick the data protocol" {
				logged.line(t, "does not accept data connections")
			}
		})
	}
}

func TestARefusedOpenIsADialFailureWithTheBrokersCode(t *testing.T) {
	for name, early := range map[string][]byte{"without early data": nil, "with early data": []byte("client hello")} {
		t.Run(name, func(t *testing.T) {
			order := dialOrder(1)
			order.EarlyData = early
			_, s, leg, conn := establishedOnData(t, order)
			leg.answer(t, status.Error(codes.NotFound, "dial 1 is not pending for this agent"))

			f := s.failure(t)
			if f.GetDialId() != 1 || codes.Code(f.GetCode()) != codes.NotFound || f.GetMessage() != "the broker refused the tunnel: dial 1 is not pending for this agent" {
				t.Errorf("dial_failure{%d, %v, %q}, want {1, NotFound, the broker's message}", f.GetDialId(), codes.Code(f.GetCode()), f.GetMessage())
			}
			if got, want := f.GetEarlyDataSent(), early != nil; got != want {
				t.Errorf("dial_failure early_data_sent %v, want %v", got, want)
			}
			// The target must not take what it got for a whole request.
			_, err := io.ReadAll(conn)
			if !errors.Is(err, syscall.ECONNRESET) {
				t.Errorf("target read after the refusal: %v, want a connection reset", err)
			}
		})
	}
}

func TestADataConnectionThatEndsBeforeTheAnswerIsADialFailure(t *testing.T) {
	_, s, leg, conn := establishedOnData(t, dialOrder(1))
	leg.reset()

	f := s.failure(t)
	if f.GetDialId() != 1 || codes.Code(f.GetCode()) != codes.Unavailable || f.GetMessage() != "the broker's data connection ended before it answered the open" {
		t.Errorf("dial_failure{%d, %v, %q}, want {1, Unavailable, ...}", f.GetDialId(), codes.Code(f.GetCode()), f.GetMessage())
	}
	if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read: %v, want a connection reset", err)
	}
}

func TestEarlyDataOnADataConnectionReachesTheTargetBeforeTheBrokersBytes(t *testing.T) {
	order := dialOrder(1)
	order.EarlyData = []byte("client hello;")
	_, _, leg, conn := establishedOnData(t, order)

	// The open has arrived; the early data does not wait for its answer,
	// which would cost the round trip it saves.
	got := make([]byte, len(order.EarlyData))
	if _, err := io.ReadFull(conn, got); err != nil || !bytes.Equal(got, order.EarlyData) {
		t.Fatalf("before the broker answered, the target read %q, %v; want the early data", got, err)
	}
	leg.answer(t, nil)
	leg.send(t, []byte("then data"))
	leg.closeWrite(t)
	rest, err := io.ReadAll(conn)
	if err != nil || string(rest) != "then data" {
		t.Errorf("the target read %q, %v after the early data, want the broker's bytes", rest, err)
	}
}

func TestADataConnectionEndedByTheBrokerAbortsTheTarget(t *testing.T) {
	for name, end := range map[string]func(*dataLeg){
		"reset": (*dataLeg).reset,
		// A close_notify where a frame could start is no close_write.
		"closed with a close_notify": func(l *dataLeg) { l.conn.Close() },
	} {
		t.Run(name, func(t *testing.T) {
			_, _, leg, conn := establishedOnData(t, dialOrder(1))
			leg.answer(t, nil)
			leg.send(t, []byte("half a request"))
			if _, err := io.ReadFull(conn, make([]byte, len("half a request"))); err != nil {
				t.Fatal(err)
			}

			// Anywhere but while idle, a connection that ends fails its
			// tunnel.
			end(leg)
			_, err := io.ReadAll(conn)
			if !errors.Is(err, syscall.ECONNRESET) {
				t.Errorf("target read after the broker ended the data connection: %v, want a connection reset", err)
			}
		})
	}
}

func TestADataConnectionTunnelOutlivesItsSession(t *testing.T) {
	b, s, leg, conn := establishedOnData(t, dialOrder(1))
	leg.answer(t, nil)

	s.finish(status.Error(codes.Unavailable, "control stream lost"))
	s.ended(t)
	b.nextSession(t) // the agent noticed, and registered again

	leg.send(t, []byte("still"))
	got := make([]byte, len("still"))
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != "still" {
		t.Fatalf("target read %q, %v", got, err)
	}
	if _, err := conn.Write([]byte("here")); err != nil {
		t.Fatal(err)
	}
	if back := leg.recvN(t, len("here")); string(back) != "here" {
		t.Fatalf("broker read %q", back)
	}
}

// TestSparesThatReachAnotherReplicaAreDroppedForTunnelStreams: behind a
// load balancer a data connection may reach another replica than the
// control stream's, which could claim none of its dials.
func TestSparesThatReachAnotherReplicaAreDroppedForTunnelStreams(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	b.otherReplica = "another-replica"
	tg := listenTarget(t)
	a := dataAgent(t, p, b, staticResolver(t, tg.addr()))
	logged := captureLog(t, a)
	stop := run(t, a)
	defer stop()
	s := b.nextSession(t)
	logged.waitLine(t, "another-replica")

	s.order(t, dialOrder(1))
	tg.accept(t)
	if tu := b.nextTunnel(t); tu.open.GetDialId() != 1 {
		t.Errorf("Tunnel opened for dial %d, want 1", tu.open.GetDialId())
	}
	if n := b.dataAccepted.Load(); n != 1 {
		t.Errorf("the agent opened %d data connections, want the one that named another replica", n)
	}
}

// TestATunnelWhoseTargetStopsReadingEndsAtTheStalledWritesBound: the
// copier from the broker is blocked writing to the target, where, once the
// broker ends the tunnel, nothing would read the data connection's reset.
func TestATunnelWhoseTargetStopsReadingEndsAtTheStalledWritesBound(t *testing.T) {
	before := promtestutil.ToFloat64(tunnelsOpen)
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	a := dataAgent(t, p, b, staticResolver(t, tg.addr()))
	a.StalledWriteTimeout = 200 * time.Millisecond
	run(t, a)
	s := b.nextSession(t)
	b.waitForFullPool(t)
	s.order(t, dialOrder(1))
	target := tg.accept(t) // and never read
	leg := b.nextDataLeg(t)
	leg.answer(t, nil)
	testutil.Eventually(t, "the tunnel to open", func() bool { return promtestutil.ToFloat64(tunnelsOpen) == before+1 })

	// The broker sends until the target's buffers and the agent's are
	// full.
	wrote := make(chan struct{})
	go func() {
		defer close(wrote)
		chunk := make([]byte, 64<<10)
		for {
			if err := leg.write(chunk); err != nil {
				return
			}
		}
	}()
	testutil.Eventually(t, "the tunnel to end once its target's write stalled", func() bool {
		return promtestutil.ToFloat64(tunnelsOpen) == before
	})
	leg.reset()
	<-wrote
	target.Close()
}

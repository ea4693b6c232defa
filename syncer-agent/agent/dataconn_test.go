package agent

import (
	"bytes"
	"context"
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
// accepts data connections, waits for its spares, sends order on one of
// them, and returns the broker, the session, the broker's side of the
// order (not answered yet) and the target's connection.
func establishedOnData(t *testing.T, order *tunnelv1.DialOrder) (*fakeBroker, *session, *dataLeg, *net.TCPConn) {
	t.Helper()
	b, s, tg, _ := withFullPool(t)
	leg := b.orderOnData(t, order)
	conn := tg.accept(t)
	return b, s, leg, conn
}

// tunnelOnDataToStop runs an agent with spares of a fresh broker that
// accepts data connections, and opens a tunnel on one of them; the test
// stops the agent, and once the broker, the target and the agent are
// stopped, nothing of theirs may be left running (goleak). It returns the
// broker, the agent's stop, the broker's leg and the target's connection.
func tunnelOnDataToStop(t *testing.T) (*fakeBroker, func(), *dataLeg, *net.TCPConn) {
	t.Helper()
	leaks := goleak.IgnoreCurrent()
	// Runs last, once the broker, the target and the agent are stopped.
	t.Cleanup(func() { goleak.VerifyNone(t, leaks) })
	b, _, tg, stop := withFullPool(t)
	leg, conn := dialOnData(t, b, tg, 1)
	return b, stop, leg, conn
}

// withFullPool runs dataAgent against a fresh broker that accepts data
// connections, and waits until its two spares are open: it returns the
// broker, the session, the target and the agent's stop.
func withFullPool(t *testing.T) (*fakeBroker, *session, *target, func()) {
	t.Helper()
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	stop := run(t, dataAgent(t, p, b, staticResolver(t, tg.addr())))
	s := b.nextSession(t)
	b.waitForFullPool(t)
	return b, s, tg, stop
}

func TestAnOrderOnADataConnectionIsConnectedAnsweredOKAndCarriesItsTunnel(t *testing.T) {
	opened := promtestutil.ToFloat64(tunnelsOpened.WithLabelValues(legDataConnection))
	dialed := promtestutil.ToFloat64(dials.WithLabelValues(codes.OK.String()))
	b, s, tg, _ := reusingAgent(t)
	order := dialOrder(1)
	order.EarlyData = []byte("client hello;")
	leg := b.orderOnData(t, order)
	conn := tg.accept(t)
	if want := newPKI(t).agentID; leg.peer != want {
		t.Errorf("the data connection's peer is %q, want the agent's SVID %q", leg.peer, want)
	}
	leg.accepted(t)
	early := make([]byte, len(order.EarlyData))
	if _, err := io.ReadFull(conn, early); err != nil || !bytes.Equal(early, order.EarlyData) {
		t.Fatalf("after the answer, the target read %q, %v; want the early data", early, err)
	}

	carryBothWays(t, leg, conn)
	if err := leg.finish(t, nil); err != nil {
		t.Errorf("the agent ended the tunnel with %v, want OK", err)
	}

	// Idle again, the connection carries the next order.
	next, conn2 := dialOnData(t, b, tg, 2)
	if next.connNo != leg.connNo {
		t.Errorf("the next order rode data connection %d, want %d, the one the tunnel before gave back", next.connNo, leg.connNo)
	}
	carryCleanly(t, next, conn2, "request", "response")
	if n := b.dataAccepted.Load(); n != 1 {
		t.Errorf("the broker took %d data connections, want 1", n)
	}
	b.noTunnel(t)
	noControlMessage(t, s)
	if got := promtestutil.ToFloat64(tunnelsOpened.WithLabelValues(legDataConnection)) - opened; got != 2 {
		t.Errorf("tunnels_opened_total{leg=data_connection} grew by %v, want 2", got)
	}
	if got := promtestutil.ToFloat64(dials.WithLabelValues(codes.OK.String())) - dialed; got != 2 {
		t.Errorf("dials_total{code=OK} grew by %v, want 2", got)
	}
}

// carryBothWays carries bytes both ways at once on leg's tunnel, each
// direction larger than a TLS record, a read buffer and a frame, and each
// ending with its half-close.
func carryBothWays(t *testing.T, leg *dataLeg, conn *net.TCPConn) {
	t.Helper()
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
}

// noControlMessage checks that the agent has sent nothing on the control
// stream since its registration: an order on a data connection is
// answered there, failed or not.
func noControlMessage(t *testing.T, s *session) {
	t.Helper()
	select {
	case m := <-s.msgs:
		t.Errorf("the agent sent %T on the control stream, want nothing", m.GetMessage())
	default:
	}
}

// reusingAgent runs an agent with one spare data connection of a fresh
// broker, on a fake clock that only the test moves: until it does, the
// pool opens no spare to replace one taken (wire.ReplaceAfterTake never
// passes), so an order rides the connection a tunnel gave back. It
// returns once the spare is in the pool.
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

// dialOnData sends order id on an idle data connection, and returns the
// broker's side of its tunnel, answered OK, and the target's connection.
func dialOnData(t *testing.T, b *fakeBroker, tg *target, id uint64) (*dataLeg, *net.TCPConn) {
	t.Helper()
	leg := b.orderOnData(t, dialOrder(id))
	conn := tg.accept(t)
	leg.accepted(t)
	return leg, conn
}

// resetTarget resets the target's connection once a byte from the broker
// has reached it.
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
	b, _, tg, _ := reusingAgent(t)
	inFlight := promtestutil.ToFloat64(tunnelsOpen)
	var first int32
	for id := uint64(1); id <= 3; id++ {
		leg, conn := dialOnData(t, b, tg, id)
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
	b, _, tg, _ := reusingAgent(t)
	inFlight := promtestutil.ToFloat64(tunnelsOpen)
	leg, conn := dialOnData(t, b, tg, 1)
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

	next, conn2 := dialOnData(t, b, tg, 2)
	if next.connNo != leg.connNo {
		t.Errorf("the next dial rode data connection %d, want %d, the one the failed tunnel gave back", next.connNo, leg.connNo)
	}
	carryCleanly(t, next, conn2, "request", "response")
}

func TestATargetThatResetsEndsTheTunnelWithUnavailableAndTheConnectionCarriesTheNextDial(t *testing.T) {
	b, _, tg, _ := reusingAgent(t)
	inFlight := promtestutil.ToFloat64(tunnelsOpen)
	leg, conn := dialOnData(t, b, tg, 1)

	resetTarget(t, leg, conn)
	testutil.CheckStatus(t, "the agent's end", leg.awaitEnd(t), codes.Unavailable, "reading from target: connection reset by peer")
	// The connection is idle once the broker's end answers the agent's.
	leg.end(t, status.Error(codes.Aborted, "the agent's leg failed"))
	leg.reused()
	tunnelsEnded(t, inFlight)

	next, conn2 := dialOnData(t, b, tg, 2)
	if next.connNo != leg.connNo {
		t.Errorf("the next dial rode data connection %d, want %d, the one the failed tunnel gave back", next.connNo, leg.connNo)
	}
	carryCleanly(t, next, conn2, "request", "response")
}

func TestABrokerThatNeverAnswersTheAgentsEndLosesTheConnection(t *testing.T) {
	b, _, tg, clk := reusingAgent(t)
	leg, conn := dialOnData(t, b, tg, 1)
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
	next, conn2 := dialOnData(t, b, tg, 2)
	if next.connNo == leg.connNo {
		t.Errorf("the next dial rode data connection %d, the one the agent reset", next.connNo)
	}
	carryCleanly(t, next, conn2, "request", "response")
	if n := b.dataAccepted.Load(); n != 2 {
		t.Errorf("the broker took %d data connections, want 2", n)
	}
}

func TestAFrameTheProtocolDoesNotAllowFailsTheTunnelAndItsConnection(t *testing.T) {
	b, _, tg, _ := reusingAgent(t)
	leg, conn := dialOnData(t, b, tg, 1)

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
	b, stop, leg, conn := tunnelOnDataToStop(t)
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

// TestAnAgentThatStopsWithATunnelOnADataConnectionResetsItAtTheEndOfItsGrace:
// the agent's stop covers the tunnels on its data connections as it covers
// its Tunnel streams, and its idle spares go at once.
func TestAnAgentThatStopsWithATunnelOnADataConnectionResetsItAtTheEndOfItsGrace(t *testing.T) {
	b, stop, leg, conn := tunnelOnDataToStop(t)
	leg.send(t, []byte("in flight"))
	if _, err := io.ReadFull(conn, make([]byte, len("in flight"))); err != nil {
		t.Fatal(err)
	}
	b.waitForSpares(t, 2) // the one left, and the replacement of the one ordered on

	stop()
	if err := leg.connEnd(); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the tunnel's data connection ended with %v, want a reset at the end of the grace", err)
	}
	if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read after the grace: %v, want a connection reset", err)
	}
	testutil.Eventually(t, "the idle spares to be closed", func() bool { return b.sparesClosed.Load() == b.dataAccepted.Load()-1 })
}

func TestAnAgentThatDrainsWaitsForATunnelOnADataConnectionAndLeavesNothingBehind(t *testing.T) {
	leaks := goleak.IgnoreCurrent()
	// Runs last, once the broker, the target and the agent are stopped.
	t.Cleanup(func() { goleak.VerifyNone(t, leaks) })
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	a := dataAgent(t, p, b, staticResolver(t, tg.addr()))
	a.Grace = time.Minute
	clk := fakeClock(a) // which the test never moves: the grace period never runs out
	stop := run(t, a)
	s := b.nextSession(t)
	b.waitForFullPool(t)
	leg, conn := dialOnData(t, b, tg, 1)
	waitUntilWaiting(t, clk, "the pace of spares") // the spare ordered on is not replaced

	// The agent takes no new dials once it drains: its idle spare goes
	// at once, while the tunnel in flight runs on, and Run waits for it.
	stopped := stopAsync(stop)
	wantDrainOfAMinute(t, s)
	testutil.Eventually(t, "the idle spare to be closed", func() bool { return b.sparesClosed.Load() == 1 })
	leg.send(t, []byte("in flight"))
	if _, err := io.ReadFull(conn, make([]byte, len("in flight"))); err != nil {
		t.Fatal(err)
	}
	select {
	case <-stopped:
		t.Fatal("Run returned while a tunnel was in flight and its grace period ran")
	default:
	}

	// Once the tunnel ends cleanly, Run returns, and the pool, drained,
	// closes the connection the tunnel gave back.
	carryCleanly(t, leg, conn, "request", "response")
	testutil.Wait(t, "Run to return after its last tunnel ended", stopped)
	testutil.Eventually(t, "the connection given back to be closed", func() bool { return b.sparesClosed.Load() == 2 })
}

// TestABrokerThatDoesNotAcceptDataConnectionsGetsTunnelStreams: without
// every condition for data connections, dials go on Tunnel streams.
func TestABrokerThatDoesNotAcceptDataConnectionsGetsTunnelStreams(t *testing.T) {
	for name, setup := range map[string]func(*pki, *fakeBroker, *Agent){
		"the broker does not set data_connections": func(_ *pki, b *fakeBroker, _ *Agent) { b.dataConnections = false },
		"the agent keeps no spares":                func(_ *pki, _ *fakeBroker, a *Agent) { a.SpareDataConnections = 0 },
		"the agent has no data credentials":        func(_ *pki, _ *fakeBroker, a *Agent) { a.DataCredentials = nil },
		// A data connection would have no session to bind to.
		"the broker names no session": func(_ *pki, b *fakeBroker, _ *Agent) { b.noSessionID = true },
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
			switch name {
			case "the handshake does not pick the data protocol":
				logged.line(t, "does not accept data connections")
			case "the broker names no session":
				logged.line(t, "names no session")
			}
		})
	}
}

func TestATargetThatRefusesIsAnsweredWithItsFailureAndTheConnectionStaysIdle(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	refusing := refusedAddr(t)
	r := &funcResolver{clusters: []string{testCluster}, resolve: func(_ context.Context, target *tunnelv1.Target) ([]string, error) {
		switch target.GetService() {
		case "refusing":
			return []string{refusing}, nil
		case "hidden":
			return nil, status.Error(codes.NotFound, "no endpoint 10.1.2.3:8443 behind it")
		}
		return []string{tg.addr()}, nil
	}}
	a := dataAgent(t, p, b, r)
	a.SpareDataConnections = 1
	fakeClock(a) // which the test never moves: no spare replaces the one ordered on
	run(t, a)
	s := b.nextSession(t)
	b.waitForPoolOf(t, 1)

	// The failures a dial_failure would carry, its message redacted; the
	// early data goes nowhere.
	for id, want := range []struct {
		service, message string
		code             codes.Code
	}{
		{"refusing", "connecting to Service default/refusing port 443: connection refused", codes.Unavailable},
		{"hidden", "no endpoint <address> behind it", codes.NotFound},
	} {
		order := dialOrder(uint64(id + 1))
		order.Target.Service, order.EarlyData = want.service, []byte("client hello")
		leg := b.orderOnData(t, order)
		st := status.Convert(leg.answer(t))
		if st.Code() != want.code || st.Message() != want.message {
			t.Errorf("the agent answered the order for %s with %v %q, want %v %q", want.service, st.Code(), st.Message(), want.code, want.message)
		}
		if leg.connNo != 1 {
			t.Errorf("order %d rode data connection %d, want 1, idle again after the failure before", id+1, leg.connNo)
		}
		leg.reused()
	}
	tg.noConnection(t)

	next, conn := dialOnData(t, b, tg, 3)
	if next.connNo != 1 {
		t.Errorf("the order after the failures rode data connection %d, want 1", next.connNo)
	}
	carryCleanly(t, next, conn, "request", "response")
	if n := b.dataAccepted.Load(); n != 1 {
		t.Errorf("the broker took %d data connections, want 1", n)
	}
	noControlMessage(t, s)
}

// TestTheEarlyDataWaitsForTheAnswer: an agent that cannot answer OK (the
// broker's connection failed while it connected) has sent the target
// none of the early data, so that a dial that fails sent none.
func TestTheEarlyDataWaitsForTheAnswer(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	resolving, resolve := make(chan struct{}, 1), make(chan struct{})
	r := &funcResolver{clusters: []string{testCluster}, resolve: func(ctx context.Context, _ *tunnelv1.Target) ([]string, error) {
		resolving <- struct{}{}
		select {
		case <-resolve:
			return []string{tg.addr()}, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}}
	a := dataAgent(t, p, b, r)
	a.SpareDataConnections = 1
	logged := captureLog(t, a)
	run(t, a)
	b.nextSession(t)
	b.waitForPoolOf(t, 1)

	order := dialOrder(1)
	order.EarlyData = []byte("client hello")
	leg := b.orderOnData(t, order)
	testutil.Wait(t, "the agent to resolve the order's target", resolving)
	leg.abort(t, b)
	close(resolve)
	conn := tg.accept(t)
	if got, _ := io.ReadAll(conn); len(got) != 0 {
		t.Errorf("the target read %q from an order the agent could not answer, want nothing", got)
	}
	logged.waitLine(t, "could not answer the dial order")
}

func TestEarlyDataOnADataConnectionFollowsTheAnswerAndPrecedesTheBrokersBytes(t *testing.T) {
	order := dialOrder(1)
	order.EarlyData = []byte("client hello;")
	_, _, leg, conn := establishedOnData(t, order)
	leg.accepted(t)
	leg.send(t, []byte("then data"))
	leg.closeWrite(t)
	got, err := io.ReadAll(conn)
	if err != nil || string(got) != "client hello;then data" {
		t.Errorf("the target read %q, %v; want the early data, then the broker's bytes", got, err)
	}
}

func TestAnOrderOnTheControlStreamGoesOnATunnelStreamWhileSparesAreIdle(t *testing.T) {
	b, s, tg, _ := withFullPool(t)

	// The broker orders on the control stream when it finds no idle
	// spare: the agent does not take one of its own.
	s.order(t, dialOrder(1))
	conn := tg.accept(t)
	tu := b.nextTunnel(t)
	if tu.open.GetDialId() != 1 {
		t.Errorf("Tunnel opened for dial %d, want 1", tu.open.GetDialId())
	}
	endTunnelCleanly(t, tu, conn)
	if n, closed := b.spares.Load(), b.sparesClosed.Load(); n != 2 || closed != 0 {
		t.Errorf("the broker holds %d idle spares and lost %d, want the 2 spares untouched", n, closed)
	}
}

func TestAMalformedOrderClosesTheConnection(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	a := dataAgent(t, p, b, staticResolver(t, tg.addr()))
	a.SpareDataConnections = 1
	logged := captureLog(t, a)
	run(t, a)
	b.nextSession(t)
	b.waitForPoolOf(t, 1)

	// A DialOrder of two bytes, whose target field claims five.
	leg := b.sendOnData(t, func(w io.Writer) error { _, err := w.Write([]byte{2, 1<<3 | 2, 5}); return err })
	if err := leg.connEnd(); errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal("the agent kept the connection the malformed order came on")
	}
	line := logged.waitLine(t, "spare data connection lost")
	if !strings.Contains(line, "Internal") || !strings.Contains(line, "dial order") {
		t.Errorf("the agent logged %q, want the broker's malformed order, Internal, in it", line)
	}
	tg.noConnection(t)
	b.waitForPoolOf(t, 1) // its replacement
}

func TestADataConnectionEndedByTheBrokerAbortsTheTarget(t *testing.T) {
	for name, end := range map[string]func(*dataLeg){
		"reset": (*dataLeg).reset,
		// A close_notify where a frame could start is no close_write.
		"closed with a close_notify": func(l *dataLeg) { l.conn.Close() },
	} {
		t.Run(name, func(t *testing.T) {
			_, _, leg, conn := establishedOnData(t, dialOrder(1))
			leg.accepted(t)
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
	leg.accepted(t)

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
	b.nextSession(t)
	b.waitForFullPool(t)
	leg := b.orderOnData(t, dialOrder(1))
	target := tg.accept(t) // and never read
	leg.accepted(t)
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

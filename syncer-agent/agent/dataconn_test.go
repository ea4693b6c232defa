package agent

import (
	"bytes"
	"errors"
	"io"
	"net"
	"slices"
	"syscall"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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

	// Both directions at once, each larger than a TLS record and than a
	// read buffer, each ending with its half-close.
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
		b, err := io.ReadAll(leg.conn) // to the close_notify
		brokerGot <- b
		errs <- err
	}()
	for chunk := range slices.Chunk(up, 50<<10) {
		if _, err := leg.conn.Write(chunk); err != nil {
			t.Fatalf("broker write: %v", err)
		}
	}
	if err := leg.conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := testutil.Wait(t, "the reads and writes", errs); err != nil {
			t.Fatal(err)
		}
	}
	if got := testutil.Wait(t, "the target's bytes", targetGot); !bytes.Equal(got, up) {
		t.Errorf("the target read %d bytes before EOF, not the %d the broker sent", len(got), len(up))
	}
	if got := testutil.Wait(t, "the broker's bytes", brokerGot); !bytes.Equal(got, down) {
		t.Errorf("the broker read %d bytes before the close_notify, not the %d the target sent", len(got), len(down))
	}
	b.noTunnel(t)
	if got := promtestutil.ToFloat64(tunnelsOpened.WithLabelValues(legDataConnection)) - opened; got != 1 {
		t.Errorf("tunnels_opened_total{leg=data_connection} grew by %v, want 1", got)
	}
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
	if _, err := leg.conn.Write([]byte("then data")); err != nil {
		t.Fatal(err)
	}
	if err := leg.conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	rest, err := io.ReadAll(conn)
	if err != nil || string(rest) != "then data" {
		t.Errorf("the target read %q, %v after the early data, want the broker's bytes", rest, err)
	}
}

func TestATargetResetAbortsTheDataConnection(t *testing.T) {
	_, _, leg, conn := establishedOnData(t, dialOrder(1))
	leg.answer(t, nil)

	if err := conn.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	// No close_notify: that would say the target's direction ended
	// cleanly.
	_, err := io.ReadAll(leg.conn)
	if err == nil {
		t.Error("the broker read a close_notify after the target reset, want the connection aborted")
	}
}

func TestADataConnectionEndedByTheBrokerAbortsTheTarget(t *testing.T) {
	_, _, leg, conn := establishedOnData(t, dialOrder(1))
	leg.answer(t, nil)
	if _, err := leg.conn.Write([]byte("half a request")); err != nil {
		t.Fatal(err)
	}

	leg.reset()
	_, err := io.ReadAll(conn)
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read after the broker ended the data connection: %v, want a connection reset", err)
	}
}

func TestADataConnectionTunnelOutlivesItsSession(t *testing.T) {
	b, s, leg, conn := establishedOnData(t, dialOrder(1))
	leg.answer(t, nil)

	s.finish(status.Error(codes.Unavailable, "control stream lost"))
	s.ended(t)
	b.nextSession(t) // the agent noticed, and registered again

	if _, err := leg.conn.Write([]byte("still")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len("still"))
	if _, err := io.ReadFull(conn, got); err != nil || string(got) != "still" {
		t.Fatalf("target read %q, %v", got, err)
	}
	if _, err := conn.Write([]byte("here")); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, len("here"))
	if _, err := io.ReadFull(leg.conn, back); err != nil || string(back) != "here" {
		t.Fatalf("broker read %q, %v", back, err)
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
			if _, err := leg.conn.Write(chunk); err != nil {
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

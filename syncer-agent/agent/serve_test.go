package agent

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestDialOrderOpensTunnelAndCarriesBytesBothWays(t *testing.T) {
	_, tu, conn := established(t)

	// Both directions at once, each larger than a frame and than a TLS
	// record, so that neither waits for the other to be read.
	up, down := randomBytes(t, 300<<10), randomBytes(t, 300<<10)
	targetGot := make(chan []byte, 1)
	targetErr := make(chan error, 2)
	go func() {
		b := make([]byte, len(up))
		_, err := io.ReadFull(conn, b)
		targetErr <- err
		targetGot <- b
	}()
	go func() {
		_, err := conn.Write(down)
		targetErr <- err
	}()
	brokerGot := make(chan []byte, 1)
	brokerErr := make(chan error, 1)
	go func() {
		b, err := tu.recvN(len(down))
		brokerErr <- err
		brokerGot <- b
	}()
	for chunk := range slices.Chunk(up, 16<<10) {
		if err := tu.send(chunk); err != nil {
			t.Fatalf("broker send: %v", err)
		}
	}

	for range 2 {
		if err := testutil.Wait(t, "the target's read and write", targetErr); err != nil {
			t.Fatalf("target: %v", err)
		}
	}
	if got := testutil.Wait(t, "the target's bytes", targetGot); !bytes.Equal(got, up) {
		t.Error("the target did not receive the bytes the broker sent")
	}
	if err := testutil.Wait(t, "the broker's read", brokerErr); err != nil {
		t.Fatalf("broker: %v", err)
	}
	if got := testutil.Wait(t, "the broker's bytes", brokerGot); !bytes.Equal(got, down) {
		t.Error("the broker did not receive the bytes the target sent")
	}
}

func TestBrokerHalfCloseReachesTargetAsEOF(t *testing.T) {
	_, tu, conn := established(t)

	if err := tu.send([]byte("request")); err != nil {
		t.Fatal(err)
	}
	if err := tu.closeWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(conn)
	if err != nil {
		t.Fatalf("target read: %v", err)
	}
	if string(got) != "request" {
		t.Errorf("target read %q before EOF, want %q", got, "request")
	}

	// The other direction stays open: the target answers after the EOF.
	if _, err := conn.Write([]byte("response")); err != nil {
		t.Fatal(err)
	}
	if err := conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	back, err := tu.recvAll()
	if err != nil {
		t.Fatalf("broker read: %v", err)
	}
	if string(back) != "response" {
		t.Errorf("broker read %q before EOF, want %q", back, "response")
	}
	tu.finish(nil)
}

func TestTargetHalfCloseReachesBrokerAsEOF(t *testing.T) {
	_, tu, conn := established(t)

	if _, err := conn.Write([]byte("banner")); err != nil {
		t.Fatal(err)
	}
	if err := conn.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := tu.recvAll()
	if err != nil {
		t.Fatalf("broker read: %v", err)
	}
	if string(got) != "banner" {
		t.Errorf("broker read %q before EOF, want %q", got, "banner")
	}

	// The other direction stays open: the broker still reaches the target.
	if err := tu.send([]byte("late")); err != nil {
		t.Fatal(err)
	}
	if err := tu.closeWrite(); err != nil {
		t.Fatal(err)
	}
	back, err := io.ReadAll(conn)
	if err != nil {
		t.Fatalf("target read: %v", err)
	}
	if string(back) != "late" {
		t.Errorf("target read %q before EOF, want %q", back, "late")
	}
	tu.finish(nil)
}

func TestTunnelEndedByBrokerAbortsTarget(t *testing.T) {
	s, tu, conn := established(t)

	tu.finish(status.Error(codes.NotFound, "no pending dial"))
	// The agent resets the target connection rather than closing it
	// gracefully: the target must not take a truncated request for a
	// complete one.
	_, err := conn.Read(make([]byte, 1))
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read after the broker ended the tunnel: %v, want a connection reset", err)
	}
	// The tunnel failed before any byte: the agent also fails the dial, in
	// case the broker had not read the open yet.
	f := s.failure(t)
	if f.GetDialId() != 1 || codes.Code(f.GetCode()) != codes.Unavailable {
		t.Errorf("dial_failure{%d, %v}, want {1, Unavailable}", f.GetDialId(), codes.Code(f.GetCode()))
	}
}

func TestTargetResetCancelsTunnel(t *testing.T) {
	_, tu, conn := established(t)

	if err := conn.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	for {
		_, err := tu.recv()
		if err == nil {
			continue
		}
		if errors.Is(err, io.EOF) {
			t.Fatal("the agent half-closed the tunnel after the target reset, want it cancelled")
		}
		break
	}
	select {
	case <-tu.stream.Context().Done():
	case <-waitCtx(t).Done():
		t.Fatal("the Tunnel stream did not end after the target reset")
	}
}

func TestBrokerProtocolErrorAbortsTarget(t *testing.T) {
	_, tu, conn := established(t)

	// A response with no frame: neither data nor close_write.
	if err := tu.stream.Send(&tunnelv1.TunnelResponse{}); err != nil {
		t.Fatal(err)
	}
	_, err := conn.Read(make([]byte, 1))
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read after a protocol error: %v, want a connection reset", err)
	}
	select {
	case <-tu.stream.Context().Done():
	case <-waitCtx(t).Done():
		t.Fatal("the agent did not end the Tunnel stream after a protocol error")
	}
}

func waitCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	t.Cleanup(cancel)
	return ctx
}

// TestDialFailuresAreReportedWithTheirCode: each way a dial order fails is
// reported on the control stream with its dial id, its code and a message
// that says what failed in words, and opens no tunnel.
func TestDialFailuresAreReportedWithTheirCode(t *testing.T) {
	for _, tc := range []dialFailure{{
		// No address in the message: the caller may be a kcp end user.
		name:    "the target refuses",
		setup:   func(t *testing.T) (lookup.Resolver, func(*testing.T)) { return staticResolver(t, refusedAddr(t)), nil },
		code:    codes.Unavailable,
		message: "connecting to Service default/webhook port 443: connection refused",
		exact:   true,
	}, {
		name:    "the Service has no endpoints",
		setup:   func(*testing.T) (lookup.Resolver, func(*testing.T)) { return resolvingTo(nil, nil), nil },
		code:    codes.Unavailable,
		message: "default/webhook",
	}, {
		name: "the static resolver does not know the Service",
		setup: func(t *testing.T) (lookup.Resolver, func(*testing.T)) {
			tg := listenTarget(t)
			return staticResolver(t, tg.addr()), tg.noConnection
		},
		service: "other",
		code:    codes.NotFound,
	}, {
		name: "the resolver says NotFound",
		setup: func(*testing.T) (lookup.Resolver, func(*testing.T)) {
			return resolvingTo(nil, status.Error(codes.NotFound, "resolver says NotFound")), nil
		},
		code:    codes.NotFound,
		message: "resolver says NotFound",
	}, {
		name: "the resolver says PermissionDenied",
		setup: func(*testing.T) (lookup.Resolver, func(*testing.T)) {
			return resolvingTo(nil, status.Error(codes.PermissionDenied, "resolver says PermissionDenied")), nil
		},
		code:    codes.PermissionDenied,
		message: "resolver says PermissionDenied",
	}, {
		name: "the resolver says FailedPrecondition",
		setup: func(*testing.T) (lookup.Resolver, func(*testing.T)) {
			return resolvingTo(nil, status.Error(codes.FailedPrecondition, "resolver says FailedPrecondition")), nil
		},
		code:    codes.FailedPrecondition,
		message: "resolver says FailedPrecondition",
	}} {
		t.Run(tc.name, tc.check)
	}
}

// resolvingTo is a resolver of the test's cluster that answers every
// target with addrs and err.
func resolvingTo(addrs []string, err error) lookup.Resolver {
	return &funcResolver{clusters: []string{testCluster}, resolve: func(context.Context, *tunnelv1.Target) ([]string, error) {
		return addrs, err
	}}
}

// dialFailure is one way a dial order fails, and how the agent must
// report it.
type dialFailure struct {
	name string
	// setup is the agent's resolver, and a check to run after the
	// failure (nil for none).
	setup   func(t *testing.T) (lookup.Resolver, func(t *testing.T))
	service string // the Service the order names; "" for the test's
	code    codes.Code
	message string // the failure's message contains it
	exact   bool   // the failure's message is message, and no more
}

// check sends dial order 7 to an agent with the case's resolver and wants
// its failure reported with id 7, the case's code and message, then the
// case's own check, and no tunnel.
func (tc dialFailure) check(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	r, after := tc.setup(t)
	run(t, newAgent(t, p, b, r))
	s := b.nextSession(t)

	o := dialOrder(7)
	if tc.service != "" {
		o.Target.Service = tc.service
	}
	s.order(t, o)
	f := s.failure(t)
	msg := f.GetMessage()
	if f.GetDialId() != 7 || codes.Code(f.GetCode()) != tc.code || !strings.Contains(msg, tc.message) || tc.exact && msg != tc.message {
		t.Errorf("dial_failure{%d, %v, %q}, want {7, %v, %q}", f.GetDialId(), codes.Code(f.GetCode()), msg, tc.code, tc.message)
	}
	if after != nil {
		after(t)
	}
	b.noTunnel(t)
}

func TestInvalidTargetIsRefusedBeforeResolving(t *testing.T) {
	for name, mutate := range map[string]func(*tunnelv1.Target){
		"cluster path":      func(t *tunnelv1.Target) { t.Cluster = "root:org" },
		"namespace":         func(t *tunnelv1.Target) { t.Namespace = "Default" },
		"service":           func(t *tunnelv1.Target) { t.Service = "1webhook" },
		"port zero":         func(t *tunnelv1.Target) { t.Port = 0 },
		"port out of range": func(t *tunnelv1.Target) { t.Port = 70000 },
		"no target":         nil,
	} {
		t.Run(name, func(t *testing.T) {
			p := newPKI(t)
			b := startBroker(t, p)
			r := &funcResolver{clusters: []string{testCluster}, resolve: func(context.Context, *tunnelv1.Target) ([]string, error) {
				return nil, errors.New("the resolver must not be asked")
			}}
			run(t, newAgent(t, p, b, r))
			s := b.nextSession(t)

			o := dialOrder(11)
			if mutate == nil {
				o.Target = nil
			} else {
				mutate(o.Target)
			}
			s.order(t, o)
			f := s.failure(t)
			if f.GetDialId() != 11 || codes.Code(f.GetCode()) != codes.InvalidArgument {
				t.Errorf("dial_failure{%d, %v, %q}, want {11, InvalidArgument}", f.GetDialId(), codes.Code(f.GetCode()), f.GetMessage())
			}
			if asked := r.targetsAsked(); len(asked) != 0 {
				t.Errorf("the resolver was asked for %v", asked)
			}
			b.noTunnel(t)
		})
	}
}

func TestAgentDialsOnlyWhatTheResolverReturns(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	good, decoy := listenTarget(t), listenTarget(t)
	refused := refusedAddr(t)
	r := &funcResolver{clusters: []string{testCluster}, resolve: func(context.Context, *tunnelv1.Target) ([]string, error) {
		// Best first: the first refuses, the second accepts.
		return []string{refused, good.addr()}, nil
	}}
	run(t, newAgent(t, p, b, r))
	s := b.nextSession(t)

	s.order(t, dialOrder(12))
	conn := good.accept(t)
	tu := b.nextTunnel(t)
	if tu.open.GetDialId() != 12 {
		t.Errorf("Tunnel opened for dial %d, want 12", tu.open.GetDialId())
	}
	decoy.noConnection(t)
	asked := r.targetsAsked()
	if len(asked) != 1 || !proto.Equal(asked[0], testTarget()) {
		t.Errorf("the resolver was asked for %v, want exactly the ordered target", asked)
	}

	// And the tunnel leads to the address the resolver returned.
	if _, err := conn.Write([]byte("from good")); err != nil {
		t.Fatal(err)
	}
	got, err := tu.recvN(len("from good"))
	if err != nil || string(got) != "from good" {
		t.Errorf("broker read %q, %v", got, err)
	}
}

func TestEveryAddressRefusedIsUnavailableAndLoggedWithItsAddress(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	first, second := refusedAddr(t), refusedAddr(t)
	r := &funcResolver{clusters: []string{testCluster}, resolve: func(context.Context, *tunnelv1.Target) ([]string, error) {
		return []string{first, second}, nil
	}}
	a := newAgent(t, p, b, r)
	logged := captureLog(t, a)
	run(t, a)
	s := b.nextSession(t)

	s.order(t, dialOrder(13))
	f := s.failure(t)
	if codes.Code(f.GetCode()) != codes.Unavailable {
		t.Errorf("code %v, want Unavailable", codes.Code(f.GetCode()))
	}
	if got, want := f.GetMessage(), "connecting to Service default/webhook port 443 (2 endpoints): connection refused"; got != want {
		t.Errorf("message %q, want %q", got, want)
	}
	// Both were tried, and the agent's log says so under the tunnel id.
	line := logged.line(t, "tunnel=000000000000000d")
	for _, addr := range []string{first, second} {
		if !strings.Contains(line, addr) {
			t.Errorf("the agent's log %q does not name %s: was it tried?", line, addr)
		}
	}
	b.noTunnel(t)
}

// The resolver's messages speak of Services and namespaces, but may name a
// refused endpoint's address: the agent sends none.
func TestAResolversAddressesAreNotSent(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	said := "service default/webhook port 443 of logical cluster root: refusing its endpoints: 127.0.0.1:8443 is a loopback address; [::1]:8443 is a loopback address"
	r := &funcResolver{clusters: []string{testCluster}, resolve: func(context.Context, *tunnelv1.Target) ([]string, error) {
		return nil, status.Error(codes.PermissionDenied, said)
	}}
	run(t, newAgent(t, p, b, r))
	s := b.nextSession(t)

	s.order(t, dialOrder(16))
	f := s.failure(t)
	want := "service default/webhook port 443 of logical cluster root: refusing its endpoints: <address> is a loopback address; <address> is a loopback address"
	if codes.Code(f.GetCode()) != codes.PermissionDenied || f.GetMessage() != want {
		t.Errorf("dial_failure{%v, %q}, want {PermissionDenied, %q}", codes.Code(f.GetCode()), f.GetMessage(), want)
	}
}

func TestResolvingPastTheOrderTimeoutIsDeadlineExceeded(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	// A resolver that answers only when the order's time is up, with an
	// address that would accept.
	r := &funcResolver{clusters: []string{testCluster}, resolve: func(ctx context.Context, _ *tunnelv1.Target) ([]string, error) {
		<-ctx.Done()
		return []string{tg.addr()}, nil
	}}
	run(t, newAgent(t, p, b, r))
	s := b.nextSession(t)

	o := dialOrder(14)
	o.TimeoutMs = 20
	s.order(t, o)
	f := s.failure(t)
	if f.GetDialId() != 14 || codes.Code(f.GetCode()) != codes.DeadlineExceeded {
		t.Errorf("dial_failure{%d, %v, %q}, want {14, DeadlineExceeded}", f.GetDialId(), codes.Code(f.GetCode()), f.GetMessage())
	}
	if want := "Service default/webhook port 443 timed out"; !strings.Contains(f.GetMessage(), want) {
		t.Errorf("message %q does not name %s", f.GetMessage(), want)
	}
	tg.noConnection(t)
	b.noTunnel(t)
}

func TestATunnelIsCountedWhileOpenAndItsDialAsOK(t *testing.T) {
	opened := promtestutil.ToFloat64(tunnelsOpened)
	open := promtestutil.ToFloat64(tunnelsOpen)
	dialed := promtestutil.ToFloat64(dials.WithLabelValues(codes.OK.String()))
	_, tu, conn := established(t)
	testutil.Eventually(t, "the tunnel to be counted", func() bool {
		return promtestutil.ToFloat64(tunnelsOpen) == open+1
	})
	if got := promtestutil.ToFloat64(tunnelsOpened) - opened; got != 1 {
		t.Errorf("tunnels_opened_total grew by %v, want 1", got)
	}
	if got := promtestutil.ToFloat64(dials.WithLabelValues(codes.OK.String())) - dialed; got != 1 {
		t.Errorf("dials_total{code=OK} grew by %v, want 1", got)
	}

	endTunnelCleanly(t, tu, conn)
	testutil.Eventually(t, "the tunnel to be counted no more", func() bool {
		return promtestutil.ToFloat64(tunnelsOpen) == open
	})
}

// TestATunnelWhoseTargetStopsReadingEndsAtTheStalledWritesBound: the
// copier from the broker is blocked writing to a target that takes
// nothing, where it does not see the broker end the Tunnel stream; the
// write fails at its bound, and the agent aborts the target.
func TestATunnelWhoseTargetStopsReadingEndsAtTheStalledWritesBound(t *testing.T) {
	open := promtestutil.ToFloat64(tunnelsOpen)
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	a := newAgent(t, p, b, staticResolver(t, tg.addr()))
	a.StalledWriteTimeout = time.Second
	run(t, a)
	b.nextSession(t).order(t, dialOrder(1))
	conn := tg.accept(t) // and never read
	tu := b.nextTunnel(t)
	sending := sendUntilTheTargetsWriteBlocks(t, tu)

	// kcp went away: the broker ends the tunnel.
	tu.finish(status.Error(codes.Canceled, "the caller went away"))
	testutil.Eventually(t, "the tunnel to end once its target's write stalled", func() bool {
		return promtestutil.ToFloat64(tunnelsOpen) == open
	})
	testutil.Wait(t, "the broker's sends to fail", sending)
	if _, err := io.Copy(io.Discard, conn); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("target read after the tunnel ended: %v, want a connection reset", err)
	}
}

// sendUntilTheTargetsWriteBlocks sends on tu from the broker until the
// target's buffers and the agent's are full, and the agent's write to the
// target blocks; the channel closes once a send fails.
func sendUntilTheTargetsWriteBlocks(t *testing.T, tu *tunnel) <-chan struct{} {
	t.Helper()
	sending := make(chan struct{})
	go func() {
		defer close(sending)
		chunk := make([]byte, 16<<10)
		for tu.send(chunk) == nil {
		}
	}()
	testutil.Eventually(t, "the agent's write to the target to block", writeToTargetBlocked)
	return sending
}

// writeToTargetBlocked reports whether a tunnel's copier from the broker
// waits for its write to the target to make progress.
func writeToTargetBlocked() bool {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "[IO wait") && strings.Contains(g, "splice.(*ConnLeg).Send(") {
			return true
		}
	}
	return false
}

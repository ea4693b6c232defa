// Package brokertest runs a broker in process for the tests of its gRPC
// services: a real gRPC server on loopback with SPIFFE mTLS from a throwaway
// CA, a registry, a policy and the broker's draining and stopping signals,
// and client connections as any identity of the trust domain.
//
// It registers no service itself: each test package registers the services
// it needs, so that a service's internal tests need not import a package that
// imports the service.
package brokertest

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/mem"
	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/registry"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// TrustDomain is the trust domain of every identity in the tests.
const TrustDomain = "example.org"

// BrokerPath is the broker's identity, as a path in TrustDomain.
const BrokerPath = "/broker"

// ID is the SPIFFE ID of path in TrustDomain.
func ID(path string) spiffeid.ID {
	return spiffeid.RequireFromPath(spiffeid.RequireTrustDomainFromString(TrustDomain), path)
}

// Server is one broker under test. Its fields are what services take.
type Server struct {
	CA       *devca.CA
	Addr     string
	Registry *registry.Registry
	Policy   *policy.Policy
	// Draining ends on Drain, Stopping on Stop.
	Draining, Stopping context.Context
	drain, stop        context.CancelFunc
	Log                *slog.Logger

	t *testing.T

	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
}

// Start serves the services register registers, under the policy pol, until
// the test t ends. The end waits for every handler to return.
func Start(t *testing.T, pol policy.File, register func(s *Server, srv *grpc.Server)) *Server {
	t.Helper()
	return StartWithOptions(t, pol, nil, register)
}

// StartWithOptions is Start with more options for the gRPC server, e.g.
// interceptors under test.
func StartWithOptions(t *testing.T, pol policy.File, opts []grpc.ServerOption, register func(s *Server, srv *grpc.Server)) *Server {
	t.Helper()
	return StartWithCredentials(t, pol, nil, opts, register)
}

// StartWithCredentials is StartWithOptions with the server's transport
// credentials wrapped by wrap (if not nil), e.g. in a guard of its
// connections under test.
func StartWithCredentials(t *testing.T, pol policy.File, wrap func(credentials.TransportCredentials) credentials.TransportCredentials,
	opts []grpc.ServerOption, register func(s *Server, srv *grpc.Server)) *Server {
	t.Helper()
	ca, err := devca.New("test", TrustDomain)
	if err != nil {
		t.Fatal(err)
	}
	p, err := policy.New(pol)
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{
		CA:       ca,
		Registry: registry.New(registry.Limits{}),
		Policy:   p,
		Log:      slog.New(slog.DiscardHandler),
		t:        t,
		conns:    map[string]*grpc.ClientConn{},
	}
	s.Draining, s.drain = context.WithCancel(context.Background())
	s.Stopping, s.stop = context.WithCancel(context.Background())
	t.Cleanup(s.drain)
	t.Cleanup(s.stop)
	creds := identity.ServerCredentials(source(t, ca, BrokerPath), tlsconfig.AuthorizeAny())
	if wrap != nil {
		creds = wrap(creds)
	}
	srv := grpc.NewServer(append([]grpc.ServerOption{
		grpc.Creds(creds),
		wire.FrameServerOption(),
		// Stop returns once every handler has: nothing outlives the test.
		grpc.WaitForHandlers(true),
	}, opts...)...)
	register(s, srv)
	s.Addr = serve(t, srv)
	return s
}

// serve serves srv on a loopback port until the test ends, and returns
// the port's address.
func serve(t *testing.T, srv *grpc.Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-served
	})
	return lis.Addr().String()
}

// Drain ends Draining: the broker begins to shut down.
func (s *Server) Drain() { s.drain() }

// Stop ends Stopping: the broker's grace period is over.
func (s *Server) Stop() { s.stop() }

// Conn is a client connection to the broker as the identity path, expecting
// the broker's identity. It lasts as long as the broker; each identity has
// one.
func (s *Server) Conn(t *testing.T, path string) *grpc.ClientConn {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if cc, ok := s.conns[path]; ok {
		return cc
	}
	creds := identity.ClientCredentials(source(t, s.CA, path), tlsconfig.AuthorizeID(ID(BrokerPath)))
	cc, err := grpc.NewClient("passthrough:///"+s.Addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	s.t.Cleanup(func() { _ = cc.Close() })
	s.conns[path] = cc
	return cc
}

// ClientTLS is the TLS configuration of a client of the broker as the
// identity path, offering HTTP/2: for a peer that speaks HTTP/2 by hand.
func (s *Server) ClientTLS(t *testing.T, path string) *tls.Config {
	t.Helper()
	src := source(t, s.CA, path)
	cfg := tlsconfig.MTLSClientConfig(src, src, tlsconfig.AuthorizeID(ID(BrokerPath)))
	cfg.NextProtos = []string{"h2"}
	return cfg
}

func source(t *testing.T, ca *devca.CA, path string) *devca.Source {
	t.Helper()
	src, err := ca.Source(devca.Leaf{SPIFFEID: path})
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// StreamContext bounds a client stream: a test that waits on a stream for
// something that never comes fails instead of hanging. It ends with t at the
// latest.
func StreamContext(t *testing.T) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(t.Context(), testutil.WaitLong)
	t.Cleanup(cancel)
	return ctx, cancel
}

// StartDial opens a Dial stream as the identity caller and sends target, as
// kcp begins a dial. The stream ends on cancel, or with t at the latest.
func (s *Server) StartDial(t *testing.T, caller string, target *tunnelv1.Target) (tunnelv1.DialService_DialClient, context.CancelFunc) {
	t.Helper()
	return s.StartDialWith(t, caller, target, nil)
}

// StartDialWith is StartDial of a dial that sends earlyData with its target.
func (s *Server) StartDialWith(t *testing.T, caller string, target *tunnelv1.Target, earlyData []byte) (tunnelv1.DialService_DialClient, context.CancelFunc) {
	t.Helper()
	ctx, cancel := StreamContext(t)
	stream, err := tunnelv1.NewDialServiceClient(s.Conn(t, caller)).Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The broker may refuse the dial before it reads the target (a caller
	// at its limit): Send then reports io.EOF, and Recv the status.
	err = stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: target}, EarlyData: earlyData})
	if err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	return stream, cancel
}

// OpenTunnel opens a Tunnel stream as the identity path for dialID, as an
// agent answers a dial order. The stream ends on cancel, or with t at the
// latest.
func (s *Server) OpenTunnel(t *testing.T, path string, dialID uint64) (tunnelv1.AgentService_TunnelClient, context.CancelFunc) {
	t.Helper()
	ctx, cancel := StreamContext(t)
	tun, err := tunnelv1.NewAgentServiceClient(s.Conn(t, path)).Tunnel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tun.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: dialID}}}); err != nil {
		t.Fatal(err)
	}
	return tun, cancel
}

// Target is the webhook the tests dial, in cluster.
func Target(cluster string) *tunnelv1.Target {
	return &tunnelv1.Target{Cluster: cluster, Namespace: "default", Service: "webhook", Port: 443}
}

// rawCodec sends a []byte as the message, as it is: what a peer sends when
// its message is not protobuf.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*[]byte) = data.Materialize()
	return nil
}

func (rawCodec) Name() string { return "proto" }

// RawStatus opens a stream of method (a full name) as the identity path,
// sends payload as its first message, bytes as they are, and returns the
// status the stream ends with; an answer before it fails the test.
func (s *Server) RawStatus(t *testing.T, path, method string, payload []byte) error {
	t.Helper()
	ctx, _ := StreamContext(t)
	desc := &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}
	stream, err := s.Conn(t, path).NewStream(ctx, desc, method, grpc.ForceCodecV2(rawCodec{}))
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.SendMsg(&payload); err != nil {
		t.Fatal(err)
	}
	var answer []byte
	err = stream.RecvMsg(&answer)
	if err == nil {
		t.Fatalf("%s answered %x, want the stream to end", method, answer)
	}
	return err
}

// NotProtobuf is a message that is not protobuf: field 1 announces 5 bytes
// and 1 follows.
var NotProtobuf = []byte{0x0a, 0x05, 'x'}

// Clock is a clock whose time moves only when a test steps it: k8s.io/utils'
// fake clock, with its AfterFunc made to behave as time.AfterFunc does. The
// fake runs the function inside Step, holding the clock's lock, where a
// function that reads the clock or resets its timer would deadlock; Clock
// runs it in a goroutine of its own. And the fake also sends the time on
// the timer's channel, which nobody reads, so that the timer's next firing
// after a Reset would block Step for ever; Clock's timers empty it first.
type Clock struct{ *clocktesting.FakeClock }

// NewClock is a Clock set to the present.
func NewClock() Clock { return Clock{clocktesting.NewFakeClock(time.Now())} }

// AfterFunc implements clock.WithDelayedExecution.
func (c Clock) AfterFunc(d time.Duration, f func()) clock.Timer {
	return funcTimer{c.FakeClock.AfterFunc(d, func() { go f() })}
}

// funcTimer is the timer of an AfterFunc.
type funcTimer struct{ clock.Timer }

func (t funcTimer) Reset(d time.Duration) bool {
	select {
	case <-t.C():
	default:
	}
	return t.Timer.Reset(d)
}

// WaitForTimers waits until at least n timers, tickers and functions wait
// on the clock, so that a Step reaches the one the test expects. (A ticker
// waits on the fake clock even once stopped.)
func (c Clock) WaitForTimers(t *testing.T, n int) {
	t.Helper()
	testutil.Eventually(t, fmt.Sprintf("%d timers to wait on the clock", n), func() bool { return c.Waiters() >= n })
}

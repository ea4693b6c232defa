package identity

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// expiryWorld is a gRPC server (the health service: Check is a unary RPC,
// Watch a stream that lasts) with the credentials and interceptors the
// broker uses, and a client whose SVID expires within seconds.
type expiryWorld struct {
	conn    *grpc.ClientConn
	health  healthpb.HealthClient
	expires time.Time
}

func newExpiryWorld(t *testing.T, grace time.Duration) *expiryWorld {
	t.Helper()
	ca := newCA(t, "ca")
	broker := newSource(t, ca, devca.Leaf{SPIFFEID: "/broker"})
	opts := append(ExpiryInterceptors(), grpc.Creds(ServerCredentials(broker, tlsconfig.AuthorizeAny(), CloseExpiredPeers(grace))))
	srv := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { defer close(served); srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-served })

	// x509 times are whole seconds: this SVID expires in 2 to 3 seconds.
	client := newSource(t, ca, devca.Leaf{SPIFFEID: "/kcp", NotAfter: time.Now().Add(3 * time.Second)})
	svid, _ := client.GetX509SVID()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(
		ClientCredentials(client, tlsconfig.AuthorizeID(spiffeid.RequireFromString("spiffe://"+testTD+"/broker")))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &expiryWorld{conn: conn, health: healthpb.NewHealthClient(conn), expires: svid.Certificates[0].NotAfter}
}

func (w *expiryWorld) check(t *testing.T) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	defer cancel()
	_, err := w.health.Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

// watch opens a stream that lasts until ctx ends or the connection does.
func (w *expiryWorld) watch(t *testing.T, ctx context.Context) healthpb.Health_WatchClient {
	t.Helper()
	stream, err := w.health.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	return stream
}

func (w *expiryWorld) waitForExpiry(t *testing.T) {
	t.Helper()
	time.Sleep(time.Until(w.expires))
	testutil.Eventually(t, "a new RPC to be refused after the SVID's expiry", func() bool {
		return status.Code(w.check(t)) == codes.Unauthenticated
	})
}

func TestAnExpiredPeerMayNotStartRPCsOnItsOpenConnection(t *testing.T) {
	w := newExpiryWorld(t, waitLong)
	if err := w.check(t); err != nil {
		t.Fatal(err)
	}
	// A stream in flight keeps the connection open past the expiry.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w.watch(t, ctx)
	w.waitForExpiry(t)

	err := w.check(t)
	st := status.Convert(err)
	if st.Code() != codes.Unauthenticated || !strings.Contains(st.Message(), "spiffe://example.org/kcp expired at "+w.expires.UTC().Format(time.RFC3339)) {
		t.Fatalf("after the expiry: %v, want Unauthenticated saying the SVID expired and when", err)
	}
	if w.conn.GetState() != connectivity.Ready {
		t.Fatalf("the connection closed while a stream was in flight, within the grace period")
	}
	// Its last RPC over, the connection closes.
	cancel()
	testutil.Eventually(t, "the connection to close after its last RPC", func() bool { return w.conn.GetState() != connectivity.Ready })
}

func TestAnExpiredPeersStreamsEndAfterTheGrace(t *testing.T) {
	w := newExpiryWorld(t, 500*time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	defer cancel()
	stream := w.watch(t, ctx)
	w.waitForExpiry(t)
	// The stream never ends on its own: the connection closes under it.
	if _, err := stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("the stream ended with %v, want Unavailable (its connection closed)", err)
	}
}

func TestAnExpiredPeersIdleConnectionCloses(t *testing.T) {
	w := newExpiryWorld(t, waitLong)
	if err := w.check(t); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(w.expires))
	// With nothing in flight, the server does not wait for the grace.
	testutil.Eventually(t, "the idle connection to close at the expiry", func() bool { return w.conn.GetState() != connectivity.Ready })
}

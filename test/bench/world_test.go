package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/mem"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The benchmarks run everything in this process: targets, an in-process
// broker and agent with SPIFFE mTLS, and kcp's dialer. Each measures one
// piece three ways where that makes sense, so that benchstat can compare:
//
//   - direct: plain loopback TCP to the target, the floor;
//   - conn:   kcpplugin's conn over one gRPC leg to a minimal DialService
//     (fakeBroker) that answers the bytes itself: the conn's copy path, gRPC
//     and TLS, without splice or agent;
//   - tunnel: kcpplugin -> broker (splice) -> agent (pipe) -> target, on
//     a Dial stream and a Tunnel stream, each dial waiting for its tunnel
//     (EarlyData off).
//
// tunnel minus conn is what the broker's splice, the agent's leg and its
// pipe add.

// world is shared by all benchmarks of the process.
var world struct {
	echo, bulk *Target
	broker     string            // in-process broker's address
	tunnel     *kcpplugin.Dialer // EarlyData off
	early      *kcpplugin.Dialer // tunnel's connection, with EarlyData
	fake       *kcpplugin.Dialer
}

const (
	benchCluster   = "root"
	benchNamespace = "bench"
)

func TestMain(m *testing.M) {
	// An experiment, not a setting of the product: gRPC's default buffer
	// pool has tiers of 16 KiB, 32 KiB and 1 MiB and zeroes a buffer's whole
	// capacity on every Get. A 32 KiB data frame encodes to 32 KiB + 4 bytes,
	// so each Marshal and each Unmarshal of one takes (and clears) a 1 MiB
	// buffer. BENCH_GRPC_POOL=fit adds a tier just above 32 KiB, process-wide
	// (client, in-process broker and agent), to show what frames that fit
	// the 32 KiB tier would gain.
	if os.Getenv("BENCH_GRPC_POOL") == "fit" {
		experimental.SetDefaultBufferPool(mem.NewTieredBufferPool(256, 4<<10, 16<<10, 32<<10, 32<<10+256, 1<<20))
	}
	os.Exit(runMain(m))
}

func runMain(m *testing.M) int {
	flag.Parse()
	if f := flag.Lookup("test.bench"); f == nil || f.Value.String() == "" {
		return m.Run() // no benchmarks asked for (e.g. make test): no world
	}
	t := &harness.Main{}
	defer t.Close()
	env := harness.NewEnv(t)
	var err error
	if world.echo, err = StartEcho(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(world.echo.Close)
	if world.bulk, err = StartBulk(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(world.bulk.Close)

	b := env.StartBroker(harness.BrokerOptions{})
	world.broker = b.Addr
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: benchCluster, Namespace: benchNamespace, Name: "echo", Ports: map[string]string{"80": world.echo.Addr}},
		{Cluster: benchCluster, Namespace: benchNamespace, Name: "bulk", Ports: map[string]string{"80": world.bulk.Addr}},
	}})
	world.early = env.Dialer(b.Addr, "/kcp") // EarlyData is kcpplugin's default
	tunnel := *world.early
	tunnel.EarlyData = false
	world.tunnel = &tunnel

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(identity.ServerCredentials(env.Identity("/broker"), tlsconfig.AuthorizeAny())))
	tunnelv1.RegisterDialServiceServer(srv, fakeBroker{})
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	world.fake = env.Dialer(l.Addr().String(), "/kcp")
	return m.Run()
}

// fakeBroker answers Dial itself, by the target's service name, with the
// targets' protocols: "echo" sends every data frame back, "bulk" serves one
// download or upload request (see Download and Upload) in 32 KiB frames, and
// anything else waits for the caller's half-close.
type fakeBroker struct {
	tunnelv1.UnimplementedDialServiceServer
}

func (fakeBroker) Dial(stream tunnelv1.DialService_DialServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	if err := stream.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Established{Established: &tunnelv1.Established{TunnelId: "fake"}}}); err != nil {
		return err
	}
	d := fakeDial{stream}
	switch first.GetTarget().GetService() {
	case "echo":
		return d.untilEOF(d.send)
	case "bulk":
		return d.bulk()
	default:
		return d.untilEOF(discard)
	}
}

// fakeDial is one established dial of the fake broker.
type fakeDial struct {
	stream tunnelv1.DialService_DialServer
}

// send sends b as a data frame.
func (d fakeDial) send(b []byte) error {
	return d.stream.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Data{Data: b}})
}

// closeWrite half-closes the dial on the fake broker's side.
func (d fakeDial) closeWrite() error {
	return d.stream.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
}

// discard takes data and does nothing with it.
func discard([]byte) error { return nil }

// untilEOF reads until the caller half-closes, handing data to f, and then
// half-closes too.
func (d fakeDial) untilEOF(f func([]byte) error) error {
	for {
		msg, err := d.stream.Recv()
		if errors.Is(err, io.EOF) {
			return d.closeWrite()
		}
		if err != nil {
			return err
		}
		if err := f(msg.GetData()); err != nil {
			return err
		}
	}
}

// bulk reads one request, an op and a size of 9 bytes in all, and serves
// the download or upload it asks for.
func (d fakeDial) bulk() error {
	var req []byte
	for len(req) < 9 {
		msg, err := d.stream.Recv()
		if err != nil {
			return err
		}
		req = append(req, msg.GetData()...)
	}
	size := int64(binary.BigEndian.Uint64(req[1:9]))
	switch req[0] {
	case opDownload:
		return d.download(size)
	case opUpload:
		return d.upload(size, int64(len(req)-9))
	}
	return fmt.Errorf("bad request %q", req[0])
}

// download sends size bytes of pattern in 32 KiB frames and half-closes.
func (d fakeDial) download(size int64) error {
	for left := size; left > 0; {
		n := min(left, 32<<10)
		if err := d.send(pattern[:n]); err != nil {
			return err
		}
		left -= n
	}
	if err := d.closeWrite(); err != nil {
		return err
	}
	return d.untilEOF(discard)
}

// upload reads until the caller sent size bytes (got of them came with the
// request) and acknowledges them with their count.
func (d fakeDial) upload(size, got int64) error {
	for got < size {
		msg, err := d.stream.Recv()
		if err != nil {
			return err
		}
		got += int64(len(msg.GetData()))
	}
	var ack [8]byte
	binary.BigEndian.PutUint64(ack[:], uint64(got))
	if err := d.send(ack[:]); err != nil {
		return err
	}
	return d.untilEOF(discard)
}

// paths are the ways a benchmark reaches a service.
// benchPath is one way to reach the targets, by name.
type benchPath struct {
	name string
	dial func(ctx context.Context, svc string) (net.Conn, error)
}

var paths = []benchPath{
	{"direct", func(ctx context.Context, svc string) (net.Conn, error) {
		addr := map[string]string{"echo": world.echo.Addr, "bulk": world.bulk.Addr}[svc]
		var d net.Dialer
		return d.DialContext(ctx, "tcp", addr)
	}},
	{"conn", func(ctx context.Context, svc string) (net.Conn, error) {
		return world.fake.DialService(ctx, benchCluster, benchNamespace, svc, 80)
	}},
	{"tunnel", func(ctx context.Context, svc string) (net.Conn, error) {
		return world.tunnel.DialService(ctx, benchCluster, benchNamespace, svc, 80)
	}},
}

// earlyPath is the tunnel with kcpplugin's EarlyData, for the benchmarks
// that open a connection per op: its dial returns at once, so only a
// first round trip measures it.
var earlyPath = benchPath{"tunnel_early", func(ctx context.Context, svc string) (net.Conn, error) {
	return world.early.DialService(ctx, benchCluster, benchNamespace, svc, 80)
}}

func dial(b *testing.B, d func(context.Context, string) (net.Conn, error), svc string) net.Conn {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := d(ctx, svc)
	if err != nil {
		b.Fatal(err)
	}
	return c
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/coalesce"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// The gRPC floor is what one gRPC stream between two processes costs on this
// machine, with the tunnel's transport settings and nothing else of ours: a
// child process echoes every message of a bidirectional stream, over SPIFFE
// mTLS with write coalescing, a 256 KiB write buffer and fixed 1 MiB
// windows, as the broker serves; the caller connects as kcp does
// (harness.Env.BrokerConn).
//
// A tunneled round trip crosses two gRPC legs each way (kcp to broker,
// broker to agent), as two of these round trips do, plus the agent's TCP
// round trip to the target: twice grpc_rtt64 is a floor under it. A dial
// opens a stream and crosses the caller's leg (Dial and its target), then the
// agent's (the order, then the agent's new Tunnel stream and its Open), and
// returns over the caller's (established), besides the agent's TCP connect:
// twice grpc_new_stream_rtt64 plus a connect is a floor under it.
//
// The rows are grpc_<figure>, with grpc= in the place of tunneled= (ratio
// grpc/direct): the direct figure is a TCP round trip on a connection (one
// process), and for a new stream a TCP connect and one round trip.

const (
	grpcCertEnv   = "TUNNELBENCH_GRPC_CERT"
	grpcKeyEnv    = "TUNNELBENCH_GRPC_KEY"
	grpcBundleEnv = "TUNNELBENCH_GRPC_BUNDLE"
)

// grpcFloor measures the gRPC floor against the direct path.
func (r *runner) grpcFloor(ctx context.Context) {
	f := r.env.SVID("/grpc-echo")
	addr, _ := startChild(r.m, "grpc-echo", grpcCertEnv+"="+f.Cert, grpcKeyEnv+"="+f.Key, grpcBundleEnv+"="+f.Bundle)
	client := tunnelv1.NewDialServiceClient(r.env.BrokerConn(r.hop(addr), "/grpc-caller"))

	direct := r.dialOrFatal(ctx, r.direct(), svcEcho)
	d, err := roundTrips(direct, r.cfg.duration)
	direct.Close()
	if err != nil {
		r.m.Fatalf("direct round trips: %v", err)
	}
	stream, err := client.Dial(ctx)
	if err != nil {
		r.m.Fatalf("grpc floor: %v", err)
	}
	g, err := roundTrips(&echoStream{stream: stream}, r.cfg.duration)
	if err != nil {
		r.m.Fatalf("grpc floor round trips: %v", err)
	}
	_ = stream.CloseSend()
	r.logf("grpc: %d round trips on one stream", len(g))
	r.report.floorRow("grpc", "rtt64_p50_us", bench.Micros(d.Quantile(0.5)), bench.Micros(g.Quantile(0.5)))
	r.report.floorRow("grpc", "rtt64_p99_us", bench.Micros(d.Quantile(0.99)), bench.Micros(g.Quantile(0.99)))

	var dn, gn bench.Samples
	msg, buf := make([]byte, msgSize), make([]byte, msgSize)
	for range r.cfg.dials {
		start := time.Now()
		c := r.dialOrFatal(ctx, r.direct(), svcEcho)
		if err := bench.RoundTrip(c, msg, buf); err != nil {
			r.m.Fatalf("direct connect and round trip: %v", err)
		}
		dn = append(dn, time.Since(start))
		c.Close()

		start = time.Now()
		s, err := client.Dial(ctx)
		if err == nil {
			err = bench.RoundTrip(&echoStream{stream: s}, msg, buf)
		}
		if err != nil {
			r.m.Fatalf("grpc floor, new stream: %v", err)
		}
		gn = append(gn, time.Since(start))
		_ = s.CloseSend()
		if _, err := s.Recv(); !errors.Is(err, io.EOF) {
			r.m.Fatalf("grpc floor, end of stream: %v", err)
		}
	}
	r.logf("grpc: %d new streams", len(gn))
	r.report.floorRow("grpc", "new_stream_rtt64_p50_us", bench.Micros(dn.Quantile(0.5)), bench.Micros(gn.Quantile(0.5)))
	r.report.floorRow("grpc", "new_stream_rtt64_p99_us", bench.Micros(dn.Quantile(0.99)), bench.Micros(gn.Quantile(0.99)))
}

// echoStream is just enough of a net.Conn over a Dial stream for
// bench.RoundTrip: each Write one message, each Read from the last one.
type echoStream struct {
	net.Conn // not used: calling any other method panics
	stream   tunnelv1.DialService_DialClient
	pending  []byte
}

func (e *echoStream) Write(p []byte) (int, error) {
	err := e.stream.Send(&tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: p}})
	if err != nil {
		return 0, err
	}
	return len(p), nil
}

func (e *echoStream) Read(p []byte) (int, error) {
	if len(e.pending) == 0 {
		m, err := e.stream.Recv()
		if err != nil {
			return 0, err
		}
		e.pending = m.GetData()
	}
	n := copy(p, e.pending)
	e.pending = e.pending[n:]
	return n, nil
}

func (*echoStream) SetDeadline(time.Time) error { return nil }

// serveGRPCEcho is the gRPC floor child's main: serve DialService as an echo
// on a loopback port it prints, until stdin closes.
func serveGRPCEcho() {
	src, err := identity.LoadFiles(identity.Files{Cert: os.Getenv(grpcCertEnv), Key: os.Getenv(grpcKeyEnv), Bundle: os.Getenv(grpcBundleEnv)}, nil)
	if err != nil {
		fatalf("grpc-echo: %v", err)
	}
	// The broker's transport settings (package wire).
	srv := grpc.NewServer(
		grpc.Creds(coalesce.Writes(identity.ServerCredentials(src, tlsconfig.AuthorizeAny()))),
		grpc.WriteBufferSize(wire.WriteBufferSize),
		grpc.InitialWindowSize(wire.WindowSize), grpc.InitialConnWindowSize(wire.ConnWindowSize),
	)
	tunnelv1.RegisterDialServiceServer(srv, echoService{})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fatalf("grpc-echo: %v", err)
	}
	go func() { _ = srv.Serve(l) }()
	fmt.Printf("listening %s\n", l.Addr())
	_, _ = io.Copy(io.Discard, os.Stdin)
	srv.Stop()
}

// echoService sends every data message of a Dial stream back.
type echoService struct {
	tunnelv1.UnimplementedDialServiceServer
}

func (echoService) Dial(stream tunnelv1.DialService_DialServer) error {
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := stream.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Data{Data: m.GetData()}}); err != nil {
			return err
		}
	}
}

package kcpplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// This file holds the fake broker the tests dial through, and small helpers.
// The fake is a real gRPC server on loopback; each test gives it a Dial
// handler that plays the broker's side of the protocol.

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// waitLong bounds every "this eventually happens" in the tests. It is far
// above anything a healthy run needs, so hitting it means a hang. A minute,
// because a 32 MiB write under the race detector took over 20 s on a machine
// loaded twenty times over its two cores.
const waitLong = time.Minute

// The target the tests dial unless they test the target itself.
const (
	testCluster   = "root"
	testNamespace = "default"
	testService   = "webhook"
	testPort      = 443
)

// dialHandler is the fake broker's Dial handler.
type dialHandler func(stream tunnelv1.DialService_DialServer) error

type fakeBroker struct {
	tunnelv1.UnimplementedDialServiceServer
	handle dialHandler
}

func (b *fakeBroker) Dial(stream tunnelv1.DialService_DialServer) error { return b.handle(stream) }

// startBroker serves handle on a loopback port and returns a Dialer that uses
// it. The server and the client connection are torn down when the test ends;
// tearing them down also ends any tunnel a failed test left open.
func startBroker(t *testing.T, handle dialHandler) *Dialer {
	t.Helper()
	return serveFakeBroker(t, handle)
}

// waitingDialer is startBroker's Dialer without EarlyData: DialService
// waits for the broker's answer.
func waitingDialer(t *testing.T, handle dialHandler) *Dialer {
	t.Helper()
	d := startBroker(t, handle)
	d.EarlyData = false
	return d
}

// serveFakeBroker serves handle as the broker's Dial on a loopback port until
// the test ends, and returns a Dialer connected to it, in plaintext.
func serveFakeBroker(tb testing.TB, handle dialHandler, opts ...grpc.ServerOption) *Dialer {
	tb.Helper()
	return serveFakeBrokerWith(tb, handle, opts, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// serveFakeBrokerWith is serveFakeBroker with the server's options and the
// client's (which must name transport credentials) given.
func serveFakeBrokerWith(tb testing.TB, handle dialHandler, serverOpts []grpc.ServerOption, clientOpts ...grpc.DialOption) *Dialer {
	tb.Helper()
	cc, err := grpc.NewClient("passthrough:///"+serveDialService(tb, handle, serverOpts...), clientOpts...)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = cc.Close() })
	return NewDialer(cc)
}

// serveDialService serves handle as the broker's Dial, with opts, on a
// loopback port until the test ends, and returns its address.
func serveDialService(tb testing.TB, handle dialHandler, opts ...grpc.ServerOption) string {
	tb.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	srv := grpc.NewServer(opts...)
	tunnelv1.RegisterDialServiceServer(srv, &fakeBroker{handle: handle})
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	tb.Cleanup(func() {
		srv.Stop()
		<-served
	})
	return lis.Addr().String()
}

// startTunnels starts a broker that establishes every dial and then hands the
// tunnel to serve.
func startTunnels(t *testing.T, serve func(p *peer) error) *Dialer {
	t.Helper()
	return startBroker(t, establish(serve))
}

// established is the broker's answer to a dial it established.
var established = &tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Established{Established: &tunnelv1.Established{TunnelId: "test"}}}

// establish reads the target, answers Established and runs serve, whose
// peer reads the dial's early data first, as the target does.
func establish(serve func(p *peer) error) dialHandler {
	return func(stream tunnelv1.DialService_DialServer) error {
		first, err := stream.Recv()
		if err != nil {
			return err
		}
		if first.GetTarget() == nil {
			return status.Error(codes.InvalidArgument, "the first message of a dial must name a target")
		}
		if err := stream.Send(established); err != nil {
			return err
		}
		return serve(&peer{stream: stream, target: first.GetTarget(), early: first.GetEarlyData()})
	}
}

// peer is the broker's side of one established tunnel.
type peer struct {
	stream tunnelv1.DialService_DialServer
	target *tunnelv1.Target
	// early is the dial's early data, which recv returns first.
	early []byte
}

func (p *peer) ctx() context.Context { return p.stream.Context() }

// send sends b as one data frame.
func (p *peer) send(b []byte) error {
	return p.stream.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Data{Data: b}})
}

// closeWrite half-closes the broker-to-caller direction.
func (p *peer) closeWrite() error {
	return p.stream.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
}

// recv returns the next data frame, io.EOF once the caller half-closed, or an
// error for anything else, including a frame that breaks the protocol.
func (p *peer) recv() ([]byte, error) {
	if early := p.early; len(early) > 0 {
		p.early = nil
		return early, nil
	}
	msg, err := p.stream.Recv()
	if err != nil {
		return nil, err
	}
	data := msg.GetData()
	if len(data) == 0 {
		return nil, fmt.Errorf("protocol error: caller sent %T, want non-empty data", msg.GetFrame())
	}
	return data, nil
}

// recvAll returns the bytes the caller sends until it half-closes.
func (p *peer) recvAll() ([]byte, error) {
	var all []byte
	for {
		data, err := p.recv()
		if errors.Is(err, io.EOF) {
			return all, nil
		}
		if err != nil {
			return all, err
		}
		all = append(all, data...)
	}
}

// echo sends back every frame until the caller half-closes, then half-closes
// too: a clean end.
func (p *peer) echo() error {
	for {
		data, err := p.recv()
		if errors.Is(err, io.EOF) {
			return p.closeWrite()
		}
		if err != nil {
			return err
		}
		if err := p.send(data); err != nil {
			return err
		}
	}
}

// spliceToLoopback is a broker that carries each tunnel to a real TCP
// connection, as the broker and the agent together do: it connects to
// 127.0.0.1 at the target's port, writes the dial's early data there,
// answers established, and then copies both ways, each half-close to the
// other side. The tunnel ends when both directions have.
func spliceToLoopback(stream tunnelv1.DialService_DialServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	target := first.GetTarget()
	if target == nil {
		return status.Error(codes.InvalidArgument, "the first message of a dial must name a target")
	}
	var d net.Dialer
	tcp, err := d.DialContext(stream.Context(), "tcp", net.JoinHostPort("127.0.0.1", fmt.Sprint(target.GetPort())))
	if err != nil {
		return status.Error(codes.Unavailable, err.Error())
	}
	defer tcp.Close()
	if err := stream.Send(established); err != nil {
		return err
	}
	p := &peer{stream: stream, target: target, early: first.GetEarlyData()}
	toTarget := make(chan error, 1)
	go func() {
		toTarget <- func() error {
			for {
				data, err := p.recv()
				if errors.Is(err, io.EOF) {
					return tcp.(*net.TCPConn).CloseWrite()
				}
				if err != nil {
					return err
				}
				if _, err := tcp.Write(data); err != nil {
					return err
				}
			}
		}()
	}()
	fromTarget := make(chan error, 1)
	go func() {
		fromTarget <- func() error {
			buf := make([]byte, wire.MaxFrame)
			for {
				n, err := tcp.Read(buf)
				if n > 0 {
					if err := p.send(buf[:n]); err != nil {
						return err
					}
				}
				if errors.Is(err, io.EOF) {
					return p.closeWrite()
				}
				if err != nil {
					return status.Error(codes.Unavailable, err.Error())
				}
			}
		}()
	}()
	// A direction that fails ends the tunnel: closing the connection ends
	// the other's copy, and returning the stream's.
	for range 2 {
		select {
		case err := <-toTarget:
			if err != nil {
				return err
			}
		case err := <-fromTarget:
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// dial opens a tunnel to the test target and closes it when the test ends.
func dial(t *testing.T, d *Dialer) net.Conn {
	t.Helper()
	c, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if err != nil {
		t.Fatalf("DialService: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// closeWriter is what callers type-assert a conn to for half-close.
type closeWriter interface{ CloseWrite() error }

func closeWrite(t *testing.T, c net.Conn) {
	t.Helper()
	cw, ok := c.(closeWriter)
	if !ok {
		t.Fatalf("%T does not implement CloseWrite", c)
	}
	if err := cw.CloseWrite(); err != nil {
		t.Fatalf("CloseWrite: %v", err)
	}
}

// result is what a goroutine in a test reports back.
type result struct {
	n    int
	data []byte
	err  error
}

func (r result) String() string {
	return fmt.Sprintf("%d bytes, error %v", r.n, r.err)
}

// within waits for one value from ch, failing the test after waitLong.
func within[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(waitLong):
		t.Fatalf("%s: still waiting after %v", what, waitLong)
		panic("unreachable")
	}
}

// stillBlocked fails the test if ch yields a value within d: the operation
// that feeds ch must not have returned yet.
func stillBlocked[T any](t *testing.T, ch <-chan T, d time.Duration, what string) {
	t.Helper()
	select {
	case v := <-ch:
		t.Fatalf("%s returned early: %v", what, v)
	case <-time.After(d):
	}
}

// goRead runs one Read of up to n bytes in a goroutine.
func goRead(c net.Conn, n int) <-chan result {
	ch := make(chan result, 1)
	go func() {
		buf := make([]byte, n)
		n, err := c.Read(buf)
		ch <- result{n: n, data: buf[:n], err: err}
	}()
	return ch
}

// goReadAll reads c until an error or EOF in a goroutine.
func goReadAll(c net.Conn) <-chan result {
	ch := make(chan result, 1)
	go func() {
		data, err := io.ReadAll(c)
		ch <- result{n: len(data), data: data, err: err}
	}()
	return ch
}

// readFull reads exactly n bytes, failing the test otherwise.
func readFull(t *testing.T, c net.Conn, n int) []byte {
	t.Helper()
	buf := make([]byte, n)
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatalf("reading %d bytes: %v", n, err)
	}
	return buf
}

func write(t *testing.T, c net.Conn, b []byte) {
	t.Helper()
	n, err := c.Write(b)
	if err != nil || n != len(b) {
		t.Fatalf("Write(%d bytes) = %d, %v", len(b), n, err)
	}
}

// isTimeout reports whether err is a deadline error as net.Conn defines it.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) && errors.As(err, &ne) && ne.Timeout()
}

// receiveDone waits until c's receive goroutine ended, i.e. its stream is
// over on the client side.
func receiveDone(t *testing.T, c net.Conn) {
	t.Helper()
	within(t, c.(*conn).received, "the end of the stream")
}

package splice_test

import (
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"sync"
	"testing"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kcp-dev/tunnel-broker/internal/splice"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// This file holds every kind of leg, each with the peer at its far end,
// played by the test over a real socket: a Tunnel stream the broker serves
// (its peer, the agent's client stream), the Tunnel stream the agent opens
// (its peer, the broker's handler), and a connection over TCP (a CONNECT
// caller, an agent's target) and over a Unix socket (a CONNECT caller of
// --egress-uds).

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// peer is the far end of a leg, played by the test.
type peer interface {
	// send sends p toward the leg, and closeWrite half-closes toward it.
	send(p []byte) error
	closeWrite() error
	// recv receives n bytes from the leg, or the error it met first:
	// io.EOF for the leg's half-close.
	recv(n int) ([]byte, error)
	// end waits for the peer's side to end, after both sides half-closed
	// or once the leg ended, and returns how: nil for a clean end.
	end() error
	// goAway leaves at once, without a half-close.
	goAway()
}

// kind is a kind of leg.
type kind struct {
	name string
	// pair makes a leg of the kind, connected to its peer.
	pair func(t *testing.T) (splice.Leg, peer)
	// resets: a failure reaches the peer as an error, not as the clean
	// end of a half-close. A Unix socket cannot say it
	// (docs/egress-selector.md).
	resets bool
	// stream: the leg's context ends when its peer goes away, even while
	// nothing reads or writes the leg. A connection's cannot: its next
	// read or write fails.
	stream bool
}

var kinds = []kind{
	{name: "server stream", pair: serverStreamPair, resets: true, stream: true},
	{name: "client stream", pair: clientStreamPair, resets: true, stream: true},
	{name: "TCP connection", pair: func(t *testing.T) (splice.Leg, peer) { return connPair(t, "tcp") }, resets: true},
	{name: "Unix socket", pair: func(t *testing.T) (splice.Leg, peer) { return connPair(t, "unix") }},
}

// tunnelServer serves AgentService's Tunnel with handle, on loopback.
type tunnelServer struct {
	tunnelv1.UnimplementedAgentServiceServer
	handle func(tunnelv1.AgentService_TunnelServer) error
}

func (s *tunnelServer) Tunnel(stream tunnelv1.AgentService_TunnelServer) error {
	return s.handle(stream)
}

// serve serves handle and returns a client connection to it.
func serve(t *testing.T, handle func(tunnelv1.AgentService_TunnelServer) error) tunnelv1.AgentServiceClient {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(wire.ServerOptions(wire.WindowSize)...)
	tunnelv1.RegisterAgentServiceServer(srv, &tunnelServer{handle: handle})
	go func() { _ = srv.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), wire.DialOptions(insecure.NewCredentials())...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
	})
	return tunnelv1.NewAgentServiceClient(conn)
}

// serverStreamPair: the leg is the stream a handler serves, as the
// broker's are; its peer is the client's stream, as an agent's or a
// caller's is.
func serverStreamPair(t *testing.T) (splice.Leg, peer) {
	legs := make(chan *splice.ServerStreamLeg, 1)
	client := serve(t, func(stream tunnelv1.AgentService_TunnelServer) error {
		leg := splice.ServerStream(stream, &tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
		legs <- leg
		return leg.Wait()
	})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := client.Tunnel(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The handler runs once the stream's headers arrive.
	if err := stream.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: 1}}}); err != nil {
		t.Fatal(err)
	}
	leg := testutil.Wait(t, "the handler's leg", legs)
	var open wire.Frame
	if err := leg.Recv(&open); err != nil {
		t.Fatal(err)
	}
	open.Free()
	return leg, &clientPeer{stream: stream, cancel: cancel}
}

// clientPeer is the client's end of a stream the broker serves.
type clientPeer struct {
	stream tunnelv1.AgentService_TunnelClient
	cancel context.CancelFunc
	// pending is what a message brought beyond what recv asked for.
	pending []byte
}

func (p *clientPeer) send(b []byte) error {
	return p.stream.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: b}})
}
func (p *clientPeer) closeWrite() error { return p.stream.CloseSend() }
func (p *clientPeer) goAway()           { p.cancel() }

func (p *clientPeer) recv(n int) ([]byte, error) {
	return collect(&p.pending, n, func() ([]byte, error) {
		msg, err := p.stream.Recv()
		switch {
		case err != nil:
			return nil, err
		case msg.GetCloseWrite() != nil:
			return nil, io.EOF
		}
		return msg.GetData(), nil
	})
}

func (p *clientPeer) end() error {
	for {
		if _, err := p.stream.Recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

// clientStreamPair: the leg is the stream a client opened, as the agent's
// Tunnel is; its peer is the handler serving it, as the broker's is.
func clientStreamPair(t *testing.T) (splice.Leg, peer) {
	peers := make(chan *handlerPeer, 1)
	client := serve(t, func(stream tunnelv1.AgentService_TunnelServer) error {
		p := &handlerPeer{stream: stream, status: make(chan error, 1)}
		peers <- p
		return p.serve()
	})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := client.Tunnel(ctx, wire.FrameCallOption())
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if err := stream.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: 1}}}); err != nil {
		t.Fatal(err)
	}
	p := testutil.Wait(t, "the handler", peers)
	if msg, err := p.stream.Recv(); err != nil || msg.GetOpen() == nil {
		t.Fatalf("the handler got %v, %v, want open", msg, err)
	}
	return splice.ClientStream(ctx, stream, cancel), p
}

// handlerPeer is the handler's end of a stream a client opened.
type handlerPeer struct {
	stream  tunnelv1.AgentService_TunnelServer
	pending []byte
	// legClosed and closed: each side's half-close, seen or sent.
	mu                sync.Mutex
	legClosed, closed bool
	// status is what the handler returns, once end decides it.
	status chan error
}

// serve is the handler: it returns what end decides, or once the stream
// ends.
func (p *handlerPeer) serve() error {
	select {
	case err := <-p.status:
		return err
	case <-p.stream.Context().Done():
		return p.stream.Context().Err()
	}
}

func (p *handlerPeer) send(b []byte) error {
	return p.stream.Send(&tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_Data{Data: b}})
}

func (p *handlerPeer) closeWrite() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	return p.stream.Send(&tunnelv1.TunnelResponse{Frame: &tunnelv1.TunnelResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
}

// goAway ends the RPC with a failure, as a broker that lost the tunnel.
func (p *handlerPeer) goAway() { p.status <- errors.New("the peer went away") }

func (p *handlerPeer) recv(n int) ([]byte, error) {
	return collect(&p.pending, n, func() ([]byte, error) {
		msg, err := p.stream.Recv()
		if errors.Is(err, io.EOF) {
			p.mu.Lock()
			p.legClosed = true
			p.mu.Unlock()
		}
		if err != nil {
			return nil, err
		}
		return msg.GetData(), nil
	})
}

// end ends the RPC with OK once both sides have half-closed, as the
// broker does; before, it waits for the client to cancel the stream.
func (p *handlerPeer) end() error {
	p.mu.Lock()
	clean := p.legClosed && p.closed
	p.mu.Unlock()
	if clean {
		p.status <- nil
		return nil
	}
	<-p.stream.Context().Done()
	return context.Cause(p.stream.Context())
}

// connPair: the leg is one end of a connection over network ("tcp" or
// "unix"), as a CONNECT caller's or an agent's target; its peer is the
// other end.
func connPair(t *testing.T, network string) (splice.Leg, peer) {
	addr := "127.0.0.1:0"
	if network == "unix" {
		addr = filepath.Join(t.TempDir(), "leg.sock")
	}
	lis, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := lis.Accept()
		accepted <- c
	}()
	c, err := net.Dial(network, lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	conn := testutil.Wait(t, "the accepted connection", accepted)
	if conn == nil {
		t.Fatal("accept failed")
	}
	return splice.NewConnLeg(conn, 0), &connPeer{conn: c}
}

// connPeer is the far end of a connection.
type connPeer struct{ conn net.Conn }

func (p *connPeer) send(b []byte) error { _, err := p.conn.Write(b); return err }
func (p *connPeer) closeWrite() error {
	return p.conn.(interface{ CloseWrite() error }).CloseWrite()
}

// goAway closes the connection with a reset where it can.
func (p *connPeer) goAway() { splice.Reset(p.conn) }

func (p *connPeer) recv(n int) ([]byte, error) {
	b := make([]byte, n)
	if _, err := io.ReadFull(p.conn, b); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			err = io.EOF
		}
		return nil, err
	}
	return b, nil
}

func (p *connPeer) end() error {
	_, err := io.Copy(io.Discard, p.conn)
	return err
}

// collect gathers n bytes from next's messages; what the last one brought
// beyond them waits in pending for the next call.
func collect(pending *[]byte, n int, next func() ([]byte, error)) ([]byte, error) {
	got := *pending
	for len(got) < n {
		b, err := next()
		if err != nil {
			return nil, err
		}
		got = append(got, b...)
	}
	*pending = got[n:]
	return got[:n], nil
}

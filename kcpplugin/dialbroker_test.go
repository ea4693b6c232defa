package kcpplugin

import (
	"crypto/tls"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// This file holds the fake broker of dial connections (docs/protocol.md
// §3.6): a real TLS listener on loopback, with mutual TLS by one
// self-signed certificate (selfSignedMTLS), that accepts every connection
// as a spare and hands each dial it reads to the test's handler, and the
// next dial on the same connection once a handler leaves it idle (§3.7).

// dialConnHandler plays the broker's side of one dial on a dial connection:
// bt holds the dial it read, and reads and writes the connection after it.
// It returns true once the tunnel has left the connection idle (each side's
// end sent and read), and the broker reads the next dial on it; false
// closes the connection.
type dialConnHandler func(bt *brokerTunnel) (idle bool)

type dialConnBroker struct {
	addr   string
	client *tls.Config
	// accepted counts the connections taken as spares, dials the dials
	// read on them.
	accepted, dials atomic.Int32
	mu              sync.Mutex
	// refuse, if set, answers new connections with it instead of taking
	// them.
	refuse  error
	spares  []net.Conn      // accepted, and no dial read yet (or again)
	tunnels []*brokerTunnel // in the order their dials were read
}

// brokerTunnel is the fake broker's side of one tunnel on a dial
// connection, which records the frames it reads.
type brokerTunnel struct {
	conn net.Conn // TLS, just after the dial
	// connNum is which accepted connection carries the tunnel, from 1.
	connNum int32
	req     *tunnelv1.DialRequest
	frames  wire.FrameReader
	// done is closed once the handler has returned; idle is what it
	// returned, set before.
	done chan struct{}
	idle bool

	mu   sync.Mutex
	read []string // what the broker read after the dial (brokerFrame.String)
}

// startDialConnBroker serves handle on dial connections until the test
// ends; protos are the ALPN protocols it offers (none: wire.DialProtocol).
func startDialConnBroker(t *testing.T, handle dialConnHandler, protos ...string) *dialConnBroker {
	t.Helper()
	certs := selfSignedMTLS(t)
	if len(protos) == 0 {
		protos = []string{wire.DialProtocol}
	}
	certs.server.NextProtos = protos
	return serveDialConns(t, handle, certs)
}

// serveDialConns is startDialConnBroker with certs as they are.
func serveDialConns(t *testing.T, handle dialConnHandler, certs mtlsConfigs) *dialConnBroker {
	t.Helper()
	lis, err := tls.Listen("tcp", "127.0.0.1:0", certs.server)
	if err != nil {
		t.Fatal(err)
	}
	b := &dialConnBroker{addr: lis.Addr().String(), client: certs.client}
	var conns sync.WaitGroup
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer conns.Done()
				defer c.Close()
				b.serve(c, handle)
			}()
		}
	}()
	t.Cleanup(func() {
		lis.Close()
		b.closeSpares()
		conns.Wait()
	})
	return b
}

// serve takes c as a spare, then reads its dials and hands each to handle,
// for as long as handle leaves c idle.
func (b *dialConnBroker) serve(c net.Conn, handle dialConnHandler) {
	if err := c.(*tls.Conn).Handshake(); err != nil {
		return
	}
	b.mu.Lock()
	refuse := b.refuse
	b.mu.Unlock()
	if refuse != nil {
		_ = wire.WriteOpenResult(c, refuse)
		return
	}
	b.setIdle(c, true)
	if wire.WriteAccepted(c, "fake") != nil {
		return
	}
	num := b.accepted.Add(1)
	for {
		req, err := wire.ReadDial(c)
		b.setIdle(c, false)
		if err != nil {
			return
		}
		b.dials.Add(1)
		bt := &brokerTunnel{conn: c, connNum: num, req: req, done: make(chan struct{})}
		b.mu.Lock()
		b.tunnels = append(b.tunnels, bt)
		b.mu.Unlock()
		bt.idle = handle(bt)
		close(bt.done)
		if !bt.idle {
			return
		}
		b.setIdle(c, true)
	}
}

// setIdle adds c to the spares, or removes it.
func (b *dialConnBroker) setIdle(c net.Conn, idle bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, s := range b.spares {
		if s == c {
			b.spares = append(b.spares[:i], b.spares[i+1:]...)
			break
		}
	}
	if idle {
		b.spares = append(b.spares, c)
	}
}

// refuseAll has b answer new connections with err instead of taking them.
func (b *dialConnBroker) refuseAll(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refuse = err
}

// closeSpares closes the spares that no dial is using, as a broker that
// drains does.
func (b *dialConnBroker) closeSpares() {
	b.mu.Lock()
	spares := b.spares
	b.spares = nil
	b.mu.Unlock()
	for _, c := range spares {
		c.Close()
	}
}

// tunnel waits for the i-th dial (from 0) the broker read, on any
// connection.
func (b *dialConnBroker) tunnel(t *testing.T, i int) *brokerTunnel {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for {
		b.mu.Lock()
		if len(b.tunnels) > i {
			bt := b.tunnels[i]
			b.mu.Unlock()
			return bt
		}
		b.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("the broker read no dial #%d within %v", i+1, waitLong)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// dialer is a Dialer with dial connections to b, whose Dial streams go to
// a fake gRPC broker serving fallback; both close with the test.
func (b *dialConnBroker) dialer(t *testing.T, spares int, fallback dialHandler) *Dialer {
	t.Helper()
	return dialerWith(t, fallback, WithDialConnections(DialConnections{Address: b.addr, TLS: b.client, Spares: spares}))
}

// dialerWith is a Dialer with opts whose Dial streams go to a fake gRPC
// broker serving handle.
func dialerWith(t *testing.T, handle dialHandler, opts ...Option) *Dialer {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	tunnelv1.RegisterDialServiceServer(srv, &fakeBroker{handle: handle})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	d := NewDialer(cc, opts...)
	t.Cleanup(func() { _ = d.Close() })
	return d
}

// brokerFrame is one frame the broker read of a tunnel.
type brokerFrame struct {
	kind wire.FrameKind
	data []byte
	end  error // an end's status; nil for OK
}

func (f brokerFrame) String() string {
	switch f.kind {
	case wire.FrameData:
		return "data " + string(f.data)
	case wire.FrameCloseWrite:
		return "close_write"
	}
	st := status.Convert(f.end)
	if st.Message() == "" {
		return "end " + st.Code().String()
	}
	return fmt.Sprintf("end %v: %s", st.Code(), st.Message())
}

// answer answers the dial: OK, and the tunnel goes in frames; or err.
func (bt *brokerTunnel) answer(err error) error {
	return wire.WriteDialResult(bt.conn, "t1", err)
}

// next reads the tunnel's next frame, a data frame whole, and records it.
func (bt *brokerTunnel) next() (brokerFrame, error) {
	kind, end, err := bt.frames.Next(bt.conn)
	if err != nil {
		return brokerFrame{}, err
	}
	f := brokerFrame{kind: kind, end: end}
	if kind == wire.FrameData {
		f.data = make([]byte, bt.frames.Unread())
		for n := 0; n < len(f.data); {
			m, err := bt.frames.Read(bt.conn, f.data[n:])
			n += m
			if err != nil && n < len(f.data) {
				return brokerFrame{}, err
			}
		}
	}
	bt.mu.Lock()
	bt.read = append(bt.read, f.String())
	bt.mu.Unlock()
	return f, nil
}

// readFrames is what the broker has read of the tunnel so far, a frame
// each.
func (bt *brokerTunnel) readFrames() []string {
	bt.mu.Lock()
	defer bt.mu.Unlock()
	return append([]string(nil), bt.read...)
}

// send writes p in data frames.
func (bt *brokerTunnel) send(p []byte) error {
	for len(p) > 0 {
		chunk := p[:min(len(p), wire.MaxFrame)]
		if _, err := bt.conn.Write(wire.AppendData(nil, chunk)); err != nil {
			return err
		}
		p = p[len(chunk):]
	}
	return nil
}

func (bt *brokerTunnel) closeWrite() error { return wire.WriteCloseWrite(bt.conn) }

// end sends the broker's end, with err's status (nil: OK).
func (bt *brokerTunnel) end(err error) error { return wire.WriteEnd(bt.conn, err) }

// awaitEnd reads and drops the tunnel's frames until the caller's end:
// true once read, after which the broker's end, if sent, leaves the
// connection idle.
func (bt *brokerTunnel) awaitEnd() bool {
	for {
		f, err := bt.next()
		if err != nil {
			return false
		}
		if f.kind == wire.FrameEnd {
			return true
		}
	}
}

// readUntilFailure reads the connection, past the frames, until it fails,
// and returns why: the caller reset or closed it.
func (bt *brokerTunnel) readUntilFailure() error {
	buf := make([]byte, 32<<10)
	for {
		if _, err := bt.conn.Read(buf); err != nil {
			return err
		}
	}
}

package kcpplugin

import (
	"crypto/tls"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// This file holds the fake broker of dial connections (docs/protocol.md
// §3.6): a real TLS listener on loopback, with mutual TLS by one
// self-signed certificate (selfSignedMTLS), that accepts every connection as a spare and
// hands each dial it reads to the test's handler.

// dialConnHandler plays the broker's side of one dial on a dial connection:
// req is the dial it read, and conn is positioned after it.
type dialConnHandler func(conn net.Conn, req *tunnelv1.DialRequest)

type dialConnBroker struct {
	addr   string
	client *tls.Config
	// accepted counts the connections taken as spares, dials the dials
	// read on them.
	accepted, dials atomic.Int32
	// refuse, if set, answers new connections with it instead of taking
	// them.
	mu     sync.Mutex
	refuse error
	spares []net.Conn // accepted, no dial read yet
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

// serve takes c as a spare, reads its dial and hands it to handle.
func (b *dialConnBroker) serve(c net.Conn, handle dialConnHandler) {
	if err := c.(*tls.Conn).Handshake(); err != nil {
		return
	}
	b.mu.Lock()
	refuse := b.refuse
	if refuse == nil {
		b.spares = append(b.spares, c)
	}
	b.mu.Unlock()
	if refuse != nil {
		_ = wire.WriteOpenResult(c, refuse)
		return
	}
	if wire.WriteAccepted(c, "fake") != nil {
		return
	}
	b.accepted.Add(1)
	req, err := wire.ReadDial(c)
	if err != nil {
		return
	}
	b.mu.Lock()
	for i, s := range b.spares {
		if s == c {
			b.spares = append(b.spares[:i], b.spares[i+1:]...)
			break
		}
	}
	b.mu.Unlock()
	b.dials.Add(1)
	handle(c, req)
}

// refuseAll has b answer new connections with err instead of taking them.
func (b *dialConnBroker) refuseAll(err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refuse = err
}

// closeSpares closes the spares that no dial has used, as a broker that
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

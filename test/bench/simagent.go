package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/kcp-dev/tunnel-broker/internal/coalesce"
	"github.com/kcp-dev/tunnel-broker/internal/identity"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/agent"
)

// SimAgent is a simulated syncer agent: its own gRPC connection to one
// broker (its own TLS session, with its own SVID and the real agent's
// transport settings) and one Connect stream that registers clusters,
// answers probes, and answers every dial order by opening a Tunnel on the
// same connection and echoing what the caller sends. Thousands of them in
// one process stand in for a fleet of agents (tunnelbench's scale phase);
// none resolves or connects to a real target.
type SimAgent struct {
	cfg     SimAgentConfig
	conn    *grpc.ClientConn
	client  tunnelv1.AgentServiceClient
	control tunnelv1.AgentService_ConnectClient
	cancel  context.CancelFunc

	sendMu sync.Mutex // a gRPC stream takes one sender at a time

	// Registered is when the broker's registered arrived.
	Registered time.Time

	socket  atomic.Pointer[simConn] // the connection's socket, once dialed
	ended   chan struct{}           // closed when the control stream has ended
	err     error                   // why it ended, once ended is closed
	tunnels sync.WaitGroup
}

// SimAgentConfig says what a SimAgent is and where it connects.
type SimAgentConfig struct {
	Broker   string
	BrokerID spiffeid.ID
	Source   identity.SVIDSource
	Name     string
	Clusters []string
	// Wire, when set, counts the bytes the connection reads and writes
	// (TLS records and TCP payload, as they cross the socket).
	Wire *WireCounter
}

// WireCounter counts the bytes of connections, both ways, on the socket.
type WireCounter struct{ Read, Written atomic.Int64 }

// simConn is a SimAgent's socket: it counts bytes, and Vanish freezes it.
type simConn struct {
	net.Conn
	wire *WireCounter // nil: not counted

	frozen   atomic.Bool
	released chan struct{} // closed when a frozen socket may close
}

func (c *simConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if c.frozen.Load() {
		<-c.released
		return 0, net.ErrClosed
	}
	if c.wire != nil {
		c.wire.Read.Add(int64(n))
	}
	return n, err
}

func (c *simConn) Write(b []byte) (int, error) {
	if c.frozen.Load() {
		return len(b), nil // dropped, as by a process that hangs
	}
	n, err := c.Conn.Write(b)
	if c.wire != nil {
		c.wire.Written.Add(int64(n))
	}
	return n, err
}

// Close closes the socket, unless it is frozen: then it stays open until
// it is released.
func (c *simConn) Close() error {
	if c.frozen.Load() {
		return nil
	}
	return c.Conn.Close()
}

// StartSimAgent connects, registers cfg.Clusters (in messages of
// agent.ClustersPerRegister clusters, as the agent sends them) and returns
// once the broker answered registered, or fails within ctx.
func StartSimAgent(ctx context.Context, cfg SimAgentConfig) (*SimAgent, error) {
	// As syncer-agent/agent.Agent.Run connects.
	opts := append(wire.DialOptions(coalesce.Writes(identity.ClientCredentials(cfg.Source, tlsconfig.AuthorizeID(cfg.BrokerID)))),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 5 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}),
		// And reconnects as it does: its backoff, its bound on an attempt.
		grpc.WithConnectParams(agent.ReconnectParams(agent.DefaultReconnectMaxDelay)))
	a := &SimAgent{cfg: cfg, ended: make(chan struct{})}
	opts = append(opts, grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		sc := &simConn{Conn: c, wire: cfg.Wire, released: make(chan struct{})}
		a.socket.Store(sc)
		return sc, nil
	}))
	conn, err := grpc.NewClient(cfg.Broker, opts...)
	if err != nil {
		return nil, err
	}
	a.conn, a.client = conn, tunnelv1.NewAgentServiceClient(conn)
	life, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	// The registration is bounded by ctx; the stream lives on.
	stop := context.AfterFunc(ctx, cancel)
	ok := false
	defer func() {
		stop()
		if !ok {
			cancel()
			conn.Close()
		}
	}()
	if a.control, err = a.client.Connect(life, grpc.WaitForReady(true)); err != nil {
		return nil, err
	}
	if err := a.register(cfg.Clusters); err != nil {
		return nil, err
	}
	first, err := a.control.Recv()
	if err != nil {
		return nil, err
	}
	if first.GetRegistered() == nil {
		return nil, fmt.Errorf("%s: the broker's first message is %T, not registered", cfg.Name, first.GetMessage())
	}
	a.Registered = time.Now()
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	ok = true
	go a.serve()
	return a, nil
}

// Reregister replaces the clusters the agent serves, as the agent does when
// a workspace is bound to or unbound from its sync target. The broker does
// not answer.
func (a *SimAgent) Reregister(clusters []string) error { return a.register(clusters) }

func (a *SimAgent) register(clusters []string) error {
	for {
		n := min(len(clusters), agent.ClustersPerRegister)
		msg := &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{
			Clusters: clusters[:n], AgentName: a.cfg.Name, More: n < len(clusters),
		}}}
		if err := a.send(msg); err != nil {
			return err
		}
		if clusters = clusters[n:]; len(clusters) == 0 {
			return nil
		}
	}
}

func (a *SimAgent) send(m *tunnelv1.ConnectRequest) error {
	a.sendMu.Lock()
	defer a.sendMu.Unlock()
	return a.control.Send(m)
}

// serve answers probes and dial orders until the control stream ends.
func (a *SimAgent) serve() {
	defer close(a.ended)
	for {
		msg, err := a.control.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = nil
			}
			a.err = err
			return
		}
		switch m := msg.GetMessage().(type) {
		case *tunnelv1.ConnectResponse_Probe:
			_ = a.send(&tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Probe{Probe: m.Probe}})
		case *tunnelv1.ConnectResponse_DialOrder:
			a.tunnels.Go(func() { a.echo(m.DialOrder.GetDialId()) })
		}
	}
}

// echo opens the tunnel of a dial and sends back what arrives on it, until
// the caller closes its side.
func (a *SimAgent) echo(dialID uint64) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := a.client.Tunnel(ctx)
	if err != nil {
		return
	}
	if err := stream.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: dialID}}}); err != nil {
		return
	}
	for {
		in, err := stream.Recv()
		if err != nil {
			return
		}
		if data := in.GetData(); len(data) > 0 {
			if err := stream.Send(&tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Data{Data: data}}); err != nil {
				return
			}
			continue
		}
		if in.GetCloseWrite() != nil {
			_ = stream.CloseSend()
			// Wait for the broker's status, which ends the stream.
			for {
				if _, err := stream.Recv(); err != nil {
					return
				}
			}
		}
	}
}

// Unregister ends the registration cleanly, as an agent that stops does:
// it closes its send direction, waits (within ctx) for the broker's status,
// which comes once the broker has unrouted it, then closes the connection.
func (a *SimAgent) Unregister(ctx context.Context) error {
	a.sendMu.Lock()
	err := a.control.CloseSend()
	a.sendMu.Unlock()
	if err == nil {
		select {
		case <-a.ended:
			err = a.err
		case <-ctx.Done():
			err = ctx.Err()
		}
	}
	a.Close()
	return err
}

// Close drops the connection at once, as a crashed agent's kernel would:
// the broker sees the TCP connection close.
func (a *SimAgent) Close() {
	a.cancel()
	a.conn.Close()
	<-a.ended
	a.tunnels.Wait()
}

// Vanish makes the agent stop answering without closing its socket, as a
// process that hangs does (or, to the broker's HTTP/2 keepalive, a network
// partition): what the broker sends is read and dropped, nothing is sent.
// The broker notices only by its keepalive. release closes the socket.
func (a *SimAgent) Vanish() (release func()) {
	sc := a.socket.Load()
	if sc == nil {
		a.Close()
		return func() {}
	}
	sc.frozen.Store(true)
	go a.Close()
	return func() {
		close(sc.released)
		sc.Conn.Close()
	}
}

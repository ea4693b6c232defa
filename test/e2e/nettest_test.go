package e2e

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"golang.org/x/net/nettest"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestATunnelThroughTheBrokerAndAgentPassesNettest runs
// golang.org/x/net/nettest's conformance suite for net.Conn over the real
// path: c1 is kcpplugin's conn, through a broker and an agent over mTLS,
// and c2 the target's accepted TCP connection. With early data, as
// kcpplugin.NewDialer dials, and with a dial that waits for the tunnel.
func TestATunnelThroughTheBrokerAndAgentPassesNettest(t *testing.T) {
	env := harness.NewEnv(t)
	b := env.StartBroker(harness.BrokerOptions{})
	env.StartAgentWithResolver(b.Addr, "/agent/sync-target-1", loopbackPorts{})
	for _, early := range []bool{true, false} {
		t.Run(fmt.Sprintf("EarlyData=%v", early), func(t *testing.T) {
			d := env.Dialer(b.Addr, "/kcp")
			d.EarlyData = early
			nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
				lis, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					return nil, nil, nil, err
				}
				target := acceptLater(lis)
				port := int32(lis.Addr().(*net.TCPAddr).Port)
				c1, err = d.DialService(context.Background(), cluster, "default", "nettest", port)
				if err != nil {
					target.Close()
					return nil, nil, nil, err
				}
				return c1, target, func() {
					c1.Close()
					target.Close()
				}, nil
			})
		})
	}
}

// loopbackPorts resolves every Service of cluster to 127.0.0.1 at the
// Service's port, where each pipe of the test listens.
type loopbackPorts struct{}

func (loopbackPorts) Resolve(_ context.Context, t *tunnelv1.Target) ([]string, error) {
	return []string{net.JoinHostPort("127.0.0.1", strconv.Itoa(int(t.GetPort())))}, nil
}

func (loopbackPorts) Clusters() []string { return []string{cluster} }

// acceptedLater is the one connection a listener accepts, as a net.Conn
// whose methods wait for it: with early data, the dial reaches the target
// at c1's first Read or Write, after the pipe is made. Close closes the
// listener, and the connection if there is one.
type acceptedLater struct {
	lis      net.Listener
	accepted chan struct{}
	// conn and err are what Accept returned, set before accepted is
	// closed.
	conn net.Conn
	err  error
}

var _ net.Conn = (*acceptedLater)(nil)

func acceptLater(lis net.Listener) *acceptedLater {
	a := &acceptedLater{lis: lis, accepted: make(chan struct{})}
	go func() {
		defer close(a.accepted)
		a.conn, a.err = lis.Accept()
		lis.Close()
	}()
	return a
}

func (a *acceptedLater) wait() (net.Conn, error) {
	<-a.accepted
	return a.conn, a.err
}

func (a *acceptedLater) Read(b []byte) (int, error) {
	c, err := a.wait()
	if err != nil {
		return 0, err
	}
	return c.Read(b)
}

func (a *acceptedLater) Write(b []byte) (int, error) {
	c, err := a.wait()
	if err != nil {
		return 0, err
	}
	return c.Write(b)
}

func (a *acceptedLater) Close() error {
	a.lis.Close()
	if c, err := a.wait(); err == nil {
		return c.Close()
	}
	return nil
}

func (a *acceptedLater) LocalAddr() net.Addr { return a.lis.Addr() }

func (a *acceptedLater) RemoteAddr() net.Addr {
	if c, err := a.wait(); err == nil {
		return c.RemoteAddr()
	}
	return nil
}

func (a *acceptedLater) SetDeadline(t time.Time) error {
	c, err := a.wait()
	if err != nil {
		return err
	}
	return c.SetDeadline(t)
}

func (a *acceptedLater) SetReadDeadline(t time.Time) error {
	c, err := a.wait()
	if err != nil {
		return err
	}
	return c.SetReadDeadline(t)
}

func (a *acceptedLater) SetWriteDeadline(t time.Time) error {
	c, err := a.wait()
	if err != nil {
		return err
	}
	return c.SetWriteDeadline(t)
}

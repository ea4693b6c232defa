package kcpplugin

import (
	"context"
	"fmt"
	"net"
	"testing"
	"time"

	"golang.org/x/net/nettest"
)

// TestTheConnPassesNettest runs golang.org/x/net/nettest's conformance
// suite for net.Conn on the conn, whose far end is the target's TCP
// connection, through a broker that splices the tunnel to it
// (spliceToLoopback): with early data, as NewDialer dials, and with a dial
// that waits for the tunnel.
func TestTheConnPassesNettest(t *testing.T) {
	d := startBroker(t, spliceToLoopback)
	for _, early := range []bool{true, false} {
		t.Run(fmt.Sprintf("EarlyData=%v", early), func(t *testing.T) {
			d := *d
			d.EarlyData = early
			nettest.TestConn(t, func() (c1, c2 net.Conn, stop func(), err error) {
				return tunnelPipe(&d)
			})
		})
	}
}

// tunnelPipe dials a tunnel to a new loopback listener: c1 is the conn,
// and c2 the listener's end, accepted when the dial reaches it (with early
// data, at c1's first Read or Write).
func tunnelPipe(d *Dialer) (c1, c2 net.Conn, stop func(), err error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, nil, err
	}
	target := acceptLater(lis)
	c1, err = d.DialService(context.Background(), testCluster, testNamespace, testService, int32(lis.Addr().(*net.TCPAddr).Port))
	if err != nil {
		target.Close()
		return nil, nil, nil, err
	}
	return c1, target, func() {
		c1.Close()
		target.Close()
	}, nil
}

// acceptedLater is the one connection a listener accepts, as a net.Conn
// whose methods wait for it. Close closes the listener, and the connection
// if there is one.
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

package kcpplugin

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

var testTarget = &tunnelv1.Target{Cluster: testCluster, Namespace: testNamespace, Service: testService, Port: testPort}

// noStreams is the fallback of tests that expect every dial to go on a
// dial connection.
func noStreams(t *testing.T) dialHandler {
	return func(tunnelv1.DialService_DialServer) error {
		t.Error("a dial went on a Dial stream, not on a dial connection")
		return status.Error(codes.Internal, "no streams here")
	}
}

// echoTunnel answers OK and echoes, the early data first, until the caller
// half-closes; it then half-closes too, which ends the tunnel with OK. A
// caller that ends the tunnel first (its Close) gets Canceled, the status
// a cancelled Dial stream ends with. Either way the connection is idle
// once the caller's end and the broker's have crossed.
func echoTunnel(bt *brokerTunnel) bool {
	if bt.answer(nil) != nil || bt.send(bt.req.GetEarlyData()) != nil {
		return false
	}
	for {
		f, err := bt.next()
		if err != nil {
			return false
		}
		switch f.kind {
		case wire.FrameData:
			if bt.send(f.data) != nil {
				return false
			}
		case wire.FrameCloseWrite:
			return bt.closeWrite() == nil && bt.end(nil) == nil && bt.awaitEnd()
		case wire.FrameEnd:
			return bt.end(status.Error(codes.Canceled, "the caller went away")) == nil
		}
	}
}

// waitForSpares waits until b has accepted n spares in all and d holds
// all it wants idle.
func waitForSpares(t *testing.T, d *Dialer, b *dialConnBroker, n int32) {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for b.accepted.Load() < n || !d.spares.Full() {
		if time.Now().After(deadline) {
			t.Fatalf("the dialer opened %d spares (want %d), its pool full: %v", b.accepted.Load(), n, d.spares.Full())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func dialTest(t *testing.T, d *Dialer) net.Conn {
	t.Helper()
	c, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestDialConnectionCarriesTheDialItsEarlyDataAndBothHalfCloses(t *testing.T) {
	var got *tunnelv1.DialRequest
	b := startDialConnBroker(t, func(bt *brokerTunnel) bool {
		got = bt.req
		return echoTunnel(bt)
	})
	d := b.dialer(t, 1, noStreams(t))
	d.EarlyData = true
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	if err := c.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatal(err)
	}
	echoed, err := io.ReadAll(c)
	if err != nil || string(echoed) != "hello" {
		t.Fatalf("read %q, %v; want the echo, then io.EOF", echoed, err)
	}
	if !proto.Equal(got.GetTarget(), testTarget) || string(got.GetEarlyData()) != "hello" {
		t.Fatalf("the broker read %v, want the target with the first write as early data", got)
	}
	if c.RemoteAddr().String() != testTarget.Key() {
		t.Fatalf("RemoteAddr = %v", c.RemoteAddr())
	}
}

func TestDialConnectionWaitsForTheBrokerWithoutEarlyData(t *testing.T) {
	answer := make(chan struct{})
	b := startDialConnBroker(t, func(bt *brokerTunnel) bool {
		if len(bt.req.GetEarlyData()) != 0 {
			t.Errorf("early data %q without EarlyData", bt.req.GetEarlyData())
		}
		<-answer
		return echoTunnel(bt)
	})
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	dialed := make(chan net.Conn, 1)
	go func() {
		c, _ := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
		dialed <- c
	}()
	select {
	case <-dialed:
		t.Fatal("DialService returned before the broker answered")
	case <-time.After(50 * time.Millisecond):
	}
	close(answer)
	c := <-dialed
	if c == nil {
		t.Fatal("DialService failed")
	}
	defer c.Close()
	roundTrip(t, c, "ping")
}

func TestDialConnectionRefusalIsTheDialsStatusOnDialOrFirstRead(t *testing.T) {
	refusal := status.Error(codes.PermissionDenied, "spiffe://test/kcp may not dial root")
	b := startDialConnBroker(t, func(bt *brokerTunnel) bool {
		_ = bt.answer(refusal)
		return false
	})
	d := b.dialer(t, 2, noStreams(t))
	waitForSpares(t, d, b, 2)
	_, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if st := status.Convert(err); st.Code() != codes.PermissionDenied || st.Message() != status.Convert(refusal).Message() {
		t.Fatalf("DialService = %v, want the broker's refusal", err)
	}
	d.EarlyData = true
	waitForSpares(t, d, b, 3)
	c := dialTest(t, d)
	if _, err := c.Write([]byte("ClientHello")); err != nil && status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Write = %v, want nil or the refusal", err)
	}
	if _, err := c.Read(make([]byte, 8)); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Read = %v, want the refusal", err)
	}
	if _, err := c.Write([]byte("more")); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Write after the refusal = %v, want it again", err)
	}
}

func TestDialConnectionUnansweredTimesOut(t *testing.T) {
	b := startDialConnBroker(t, func(bt *brokerTunnel) bool {
		_, _ = io.Copy(io.Discard, bt.conn) // never answers
		return false
	})
	d := b.dialer(t, 1, noStreams(t))
	d.Timeout = 100 * time.Millisecond
	waitForSpares(t, d, b, 1)
	_, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("DialService = %v, want DeadlineExceeded", err)
	}
}

func TestDialConnectionReadDeadlineBoundsTheWaitButNotTheAnswer(t *testing.T) {
	answer := make(chan struct{})
	b := startDialConnBroker(t, func(bt *brokerTunnel) bool {
		<-answer
		return echoTunnel(bt)
	})
	d := b.dialer(t, 1, noStreams(t))
	d.EarlyData = true
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read before the answer = %v, want the deadline", err)
	}
	close(answer)
	_ = c.SetReadDeadline(time.Time{})
	roundTrip(t, c, "after")
}

// The tunnels stay open: a tunnel that gives its connection back has it
// carry the next dial instead (TestDialsInARowRideOneDialConnection).
func TestDialsUseSparesAndTheDialerReplacesThoseTheirTunnelsKeep(t *testing.T) {
	b := startDialConnBroker(t, echoTunnel)
	d := b.dialer(t, 2, noStreams(t))
	for i := range 5 {
		waitForSpares(t, d, b, int32(2+i))
		roundTrip(t, dialTest(t, d), "x")
	}
	if n := b.dials.Load(); n != 5 {
		t.Fatalf("the broker read %d dials on dial connections, want 5", n)
	}
	waitForSpares(t, d, b, 7)
}

func TestLostSpareIsReplaced(t *testing.T) {
	b := startDialConnBroker(t, echoTunnel)
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	b.closeSpares()
	waitForSpares(t, d, b, 2)
	roundTrip(t, dialTest(t, d), "x")
}

func TestDialsGoOnStreamsWhenNoSpareIsLeftOrTheBrokerRefusesThem(t *testing.T) {
	fallback := establish((*peer).echo)
	for name, broker := range map[string]func() *dialConnBroker{
		"older broker": func() *dialConnBroker { return startDialConnBroker(t, echoTunnel, "h2") },
		"refused":      func() *dialConnBroker { b := startDialConnBroker(t, echoTunnel); b.refuseAll(errOverSpares); return b },
	} {
		t.Run(name, func(t *testing.T) {
			d := broker().dialer(t, 2, fallback)
			roundTrip(t, dialTest(t, d), "on a stream")
		})
	}
}

var errOverSpares = status.Error(codes.ResourceExhausted, "too many spare dial connections")

func roundTrip(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
		t.Fatalf("round trip read %q, %v; want %q", buf, err, msg)
	}
}

func TestClosingTheDialerEndsItsTunnelsOnDialConnections(t *testing.T) {
	ended := make(chan struct{})
	b := startDialConnBroker(t, func(bt *brokerTunnel) bool {
		defer close(ended)
		return echoTunnel(bt)
	})
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	c := dialTest(t, d)
	roundTrip(t, c, "before the dialer closes")
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ended:
	case <-time.After(waitLong):
		t.Fatal("the broker's side of the tunnel did not end when the dialer closed")
	}
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("Read on a tunnel of a closed dialer succeeded")
	}
}

func TestABrokersMalformedAnswerIsInternal(t *testing.T) {
	b := startDialConnBroker(t, func(bt *brokerTunnel) bool {
		_, _ = bt.conn.Write([]byte{3, 0xff, 0xff, 0xff}) // not an OpenResult
		return false
	})
	d := b.dialer(t, 1, noStreams(t))
	waitForSpares(t, d, b, 1)
	_, err := d.DialService(context.Background(), testCluster, testNamespace, testService, testPort)
	if status.Code(err) != codes.Internal {
		t.Fatalf("DialService = %v, want Internal: the broker broke the protocol", err)
	}
}

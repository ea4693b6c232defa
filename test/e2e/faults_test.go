package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// faultDialTimeout is the broker's dial timeout in TestFaults: short, so a
// dial that waits for it is quick to tell from one that fails at once.
const faultDialTimeout = time.Second

// boundedWait bounds every "this happens soon" in TestFaults; far above
// what a healthy run needs, so hitting it means a hang.
const boundedWait = 15 * time.Second

// faults is the world TestFaults' rows share: a broker, an agent that
// serves a misbehaving target of each kind, and a caller.
type faults struct {
	env    *harness.Env
	broker *harness.Broker
	kcp    *kcpplugin.Dialer
	// hung holds the connections of the target that hangs after accept.
	hung *hanger
	// chatterEnded learns why each connection of the chatter target ended.
	chatterEnded chan error
}

// TestFaults makes one thing fail at a time, for each asserts the status the
// caller sees, and then that the broker, the agent and the caller (all in
// this process) hold no more goroutines and open files than before.
func TestFaults(t *testing.T) {
	w := newFaults(t)
	rows := []struct {
		name string
		run  func(w *faults, t *testing.T)
	}{
		{"target refuses", (*faults).targetRefuses},
		{"target hangs at connect", (*faults).targetHangsAtConnect},
		{"target hangs after accept", (*faults).targetHangsAfterAccept},
		{"target resets mid-stream", (*faults).targetResetsMidStream},
		{"agent cancels its control stream mid-dial", func(w *faults, t *testing.T) {
			w.agentVanishesMidDial(t, func(cancel context.CancelFunc, _ *grpc.ClientConn) { cancel() })
		}},
		{"agent's connection drops mid-dial", func(w *faults, t *testing.T) {
			w.agentVanishesMidDial(t, func(_ context.CancelFunc, cc *grpc.ClientConn) { cc.Close() })
		}},
		{"caller's connection drops mid-transfer", (*faults).callerConnectionDrops},
		{"caller closes the tunnel mid-transfer", (*faults).callerClosesMidTransfer},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			base := quietBaseline(t, w.broker)
			row.run(w, t)
			base.checkNoLeaks(t, row.name)
		})
	}
}

// newFaults starts TestFaults' world: a broker with a short dial timeout,
// an agent serving a target of each kind of fault and an echo server, and
// a caller whose connection to the broker is made.
func newFaults(t *testing.T) *faults {
	env := harness.NewEnv(t)
	w := &faults{
		env:          env,
		broker:       env.StartBroker(harness.BrokerOptions{DialTimeout: faultDialTimeout}),
		hung:         newHanger(t),
		chatterEnded: make(chan error, 16),
	}
	targets := map[string]string{
		"echo":    harness.StartEcho(t),
		"refuses": closedPort(t),
		"stuck":   unacceptingListener(t),
		"hangs":   startTarget(t, w.hung.hold),
		"resets":  startTarget(t, resetAfterExchange),
		"chatter": startTarget(t, chatter(w.chatterEnded)),
	}
	var services lookup.StaticFile
	for name, addr := range targets {
		services.Services = append(services.Services, lookup.StaticService{
			Cluster: "root", Namespace: "default", Name: name, Ports: map[string]string{"80": addr},
		})
	}
	env.StartAgent(w.broker.Addr, "/agent/sync-target-1", services)
	w.kcp = env.Dialer(w.broker.Addr, "/kcp")
	// The caller's connection to the broker is made on its first dial.
	if err := echoDial(w.kcp); err != nil {
		t.Fatalf("warm-up dial: %v", err)
	}
	return w
}

func (w *faults) targetRefuses(t *testing.T) {
	_, err := w.dial(t, "refuses")
	testutil.CheckStatus(t, "dial", err, codes.Unavailable, "connection refused")
}

func (w *faults) targetHangsAtConnect(t *testing.T) {
	_, err := w.dial(t, "stuck")
	// From the broker's timer or the agent's own, whichever is first; not
	// the caller's (its timeout is far longer).
	testutil.CheckStatus(t, "dial", err, codes.DeadlineExceeded, "agent ")
}

func (w *faults) targetHangsAfterAccept(t *testing.T) {
	conn, err := w.dial(t, "hangs")
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	if _, err := conn.Write([]byte("anybody there?\n")); err != nil {
		t.Fatalf("write: %v", err)
	}
	conn.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	n, err := conn.Read(make([]byte, 16))
	var ne net.Error
	if n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
		t.Errorf("Read = %d, %v; want a timeout", n, err)
	}
	conn.Close()
	// The target still holds its end: after kcpplugin's close linger, the
	// broker and agent end the tunnel and the agent aborts its connection
	// to the target.
	harness.Eventually(t, boundedWait, "the broker to end the tunnel", func() bool {
		return brokerTunnels(w.broker) == 0
	})
	if n := w.hung.release(); n != 1 {
		t.Errorf("the hanging target held %d connections, want 1", n)
	}
}

func (w *faults) targetResetsMidStream(t *testing.T) {
	conn, err := w.dial(t, "resets")
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(boundedWait))
	got := make([]byte, len(greeting))
	if _, err := io.ReadFull(conn, got); err != nil || !bytes.Equal(got, greeting) {
		t.Fatalf("read %q, %v; want the greeting", got, err)
	}
	if _, err := conn.Write([]byte("ack\n")); err != nil {
		t.Fatalf("write: %v", err)
	}
	n, err := conn.Read(make([]byte, 16))
	if n != 0 {
		t.Errorf("read %d bytes after the reset", n)
	}
	testutil.CheckStatus(t, "Read", err, codes.Unavailable, "agent's side")
}

func (w *faults) callerConnectionDrops(t *testing.T) {
	cc := w.rowEnv(t).BrokerConn(w.broker.Addr, "/kcp")
	defer cc.Close()
	conn := w.midTransfer(t, waitingDialer(cc))
	defer conn.Close()
	cc.Close()
	// Data already received may come first; then the end.
	conn.SetReadDeadline(time.Now().Add(boundedWait))
	_, err := io.Copy(io.Discard, conn)
	if !errors.Is(err, net.ErrClosed) && status.Code(err) != codes.Canceled {
		t.Errorf("Read after the caller's connection closed: %v, want Canceled (net.ErrClosed)", err)
	}
	w.targetSeesEnd(t)
}

func (w *faults) callerClosesMidTransfer(t *testing.T) {
	conn := w.midTransfer(t, w.kcp)
	conn.Close()
	if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
		t.Errorf("Read after Close: %v, want net.ErrClosed", err)
	}
	// The target keeps sending, so the stream cannot end cleanly:
	// kcpplugin cancels it after its close linger, and the agent aborts
	// the target's connection.
	w.targetSeesEnd(t)
}

// dial dials service in root through the shared caller. A dial must end
// well before the caller's own timeout: a status from the caller's side
// would not say what failed.
func (w *faults) dial(t *testing.T, service string) (net.Conn, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return w.kcp.DialService(ctx, "root", "default", service, 80)
}

// rowEnv is the test's trust domain, with cleanups and failures of t.
func (w *faults) rowEnv(t *testing.T) *harness.Env {
	return &harness.Env{T: t, Dir: t.TempDir(), CA: w.env.CA}
}

// agentVanishesMidDial registers a raw agent for a cluster of its own and,
// when the broker orders it to dial, makes it vanish with drop. The dial
// must fail at once with Unavailable, not wait for the broker's timeout.
func (w *faults) agentVanishesMidDial(t *testing.T, drop func(context.CancelFunc, *grpc.ClientConn)) {
	cc := w.rowEnv(t).BrokerConn(w.broker.Addr, "/agent/silent")
	defer cc.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := tunnelv1.NewAgentServiceClient(cc).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	register := &tunnelv1.ConnectRequest{Message: &tunnelv1.ConnectRequest_Register{Register: &tunnelv1.Register{
		Clusters: []string{"flaky"}, AgentName: "flaky",
	}}}
	if err := stream.Send(register); err != nil {
		t.Fatal(err)
	}
	if msg, err := stream.Recv(); err != nil || msg.GetRegistered() == nil {
		t.Fatalf("registering: %v %v", msg, err)
	}
	ordered := make(chan *tunnelv1.DialOrder, 1)
	ended := make(chan error, 1)
	go func() {
		for {
			msg, err := stream.Recv()
			if err != nil {
				ended <- err
				return
			}
			if o := msg.GetDialOrder(); o != nil {
				ordered <- o
				drop(cancel, cc)
			}
		}
	}()

	ctx2, cancel2 := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel2()
	conn, err := w.kcp.DialService(ctx2, "flaky", "default", "webhook", 443)
	if conn != nil {
		conn.Close()
	}
	testutil.CheckStatus(t, "dial", err, codes.Unavailable, "went away")
	select {
	case o := <-ordered:
		if o.GetTarget().GetService() != "webhook" {
			t.Errorf("the order named %v", o.GetTarget())
		}
	default:
		t.Error("the dial failed before the agent got its order")
	}
	select {
	case <-ended:
	case <-time.After(boundedWait):
		t.Fatal("the vanished agent's stream did not end")
	}
}

// midTransfer dials the chatter target through d and reads some of what it
// sends: the tunnel is busy.
func (w *faults) midTransfer(t *testing.T, d *kcpplugin.Dialer) net.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := d.DialService(ctx, "root", "default", "chatter", 80)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	conn.SetReadDeadline(time.Now().Add(boundedWait))
	if _, err := io.ReadFull(conn, make([]byte, 4096)); err != nil {
		conn.Close()
		t.Fatalf("read: %v", err)
	}
	return conn
}

// targetSeesEnd waits until the chatter target's connection has failed.
func (w *faults) targetSeesEnd(t *testing.T) {
	t.Helper()
	select {
	case err := <-w.chatterEnded:
		t.Logf("the target saw: %v", err)
	case <-time.After(boundedWait):
		t.Fatalf("the target's connection did not end within %v", boundedWait)
	}
}

// echoDial dials the echo target and makes one round trip.
func echoDial(d *kcpplugin.Dialer) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := d.DialService(ctx, "root", "default", "echo", 80)
	if err != nil {
		return err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(boundedWait))
	if err := echoOnce(conn, []byte("ping\n")); err != nil {
		return err
	}
	return conn.Close()
}

// greeting is what resetAfterExchange sends first.
var greeting = []byte("hello from the target\n")

// resetAfterExchange sends a greeting, reads an answer, and then aborts the
// connection: a target that fails mid-stream.
func resetAfterExchange(c *net.TCPConn) {
	defer c.Close()
	if _, err := c.Write(greeting); err != nil {
		return
	}
	if _, err := io.ReadFull(c, make([]byte, 4)); err != nil {
		return
	}
	c.SetLinger(0)
}

// closedPort is a loopback address where nothing listens: connecting to it
// is refused.
func closedPort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// unacceptingListener is a loopback address whose listener never accepts
// and whose accept queue is full, so that the kernel drops further SYNs and
// a connect there hangs until its timeout. A backlog of 0 leaves room for
// one queued connection, which it fills.
func unacceptingListener(t *testing.T) string {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
	filler, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatalf("filling the accept queue: %v", err)
	}
	t.Cleanup(func() { filler.Close() })
	// Check that it hangs: a second connect must not complete.
	if c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond); err == nil {
		c.Close()
		t.Fatal("a connect to a full accept queue completed; the hang-at-connect row would prove nothing")
	}
	return addr
}

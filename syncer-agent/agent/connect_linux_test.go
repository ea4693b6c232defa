package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// unanswered returns a loopback address whose connects hang: a listener
// with a full accept queue, whose SYNs Linux drops.
func unanswered(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	// A backlog of 0 holds one connection; nobody accepts it.
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", sa.(*syscall.SockaddrInet4).Port)
	filler, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = filler.Close() })
	// The kernel may answer a full queue with a reset
	// (tcp_abort_on_overflow) instead of dropping the SYN.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if c != nil {
		c.Close()
	}
	// A connect that hangs fails by its context's deadline, which the
	// poller may see before the context does.
	if err == nil || ctx.Err() == nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Skipf("connects to a full accept queue do not hang here (%v)", err)
	}
	return addr
}

func TestConnectTimeoutIsReportedDeadlineExceeded(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	hang := unanswered(t)
	r := &funcResolver{clusters: []string{testCluster}, resolve: func(context.Context, *tunnelv1.Target) ([]string, error) {
		return []string{hang}, nil
	}}
	run(t, newAgent(t, p, b, r))
	s := b.nextSession(t)

	o := dialOrder(15)
	o.TimeoutMs = 100
	s.order(t, o)
	f := s.failure(t)
	if f.GetDialId() != 15 || codes.Code(f.GetCode()) != codes.DeadlineExceeded {
		t.Errorf("dial_failure{%d, %v, %q}, want {15, DeadlineExceeded}", f.GetDialId(), codes.Code(f.GetCode()), f.GetMessage())
	}
	if want := "connecting to Service default/webhook port 443 timed out after 100ms"; f.GetMessage() != want {
		t.Errorf("message %q, want %q", f.GetMessage(), want)
	}
	b.noTunnel(t)
}

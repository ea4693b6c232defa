package harness

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"time"
)

// StartUnanswered returns a loopback address whose connects hang: a
// listener whose accept queue is full and never accepted from. Linux drops
// the SYNs it gets, so a connect to it waits for its own timeout, like one
// to a webhook pod that stopped answering.
func StartUnanswered(t T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	// A backlog of 0 holds one connection: the filler below.
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
	// (net.ipv4.tcp_abort_on_overflow) instead of dropping the SYN.
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if c != nil {
		c.Close()
	}
	// A connect that hangs fails by its context's deadline, which the
	// poller may see before the context does.
	if err == nil || ctx.Err() == nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a connect to a full accept queue does not hang on this machine (%v): is net.ipv4.tcp_abort_on_overflow set?", err)
	}
	return addr
}

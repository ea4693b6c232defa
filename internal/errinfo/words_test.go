package errinfo

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// opError is a failure as Go's network code reports it, naming both ends.
func opError(op string, err error) error {
	return &net.OpError{Op: op, Net: "tcp", Source: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 7), Port: 42610},
		Addr: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 8443}, Err: os.NewSyscallError(op, err)}
}

func TestAConnectFailureIsWordedByItsType(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{opError("dial", syscall.ECONNREFUSED), "connection refused"},
		{opError("dial", syscall.EHOSTUNREACH), "no route to host"},
		{&net.DNSError{Err: "no such host", Name: "web.example", IsNotFound: true}, "no such host"},
		{&net.DNSError{Err: "server misbehaving", Name: "web.example"}, "the name did not resolve"},
		{fmt.Errorf("dial: %w", os.ErrDeadlineExceeded), "timed out"},
		{context.Canceled, "cancelled"},
		{io.EOF, "the target closed the connection"},
		{status.Error(codes.Unavailable, "transport is closing"), "the broker's stream ended (Unavailable)"},
		{fmt.Errorf("10.0.0.1:8443 did something"), "the connection failed"},
	} {
		if got := ConnectFailure(tc.err); got != tc.want {
			t.Errorf("ConnectFailure(%v) = %q, want %q", tc.err, got, tc.want)
		}
	}
}

func TestAnAgentsLossIsWordedWithoutAddresses(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{opError("read", syscall.ECONNRESET), "the agent's connection to the broker broke (connection reset by peer)"},
		{net.ErrClosed, "the agent's connection to the broker broke"},
		{io.ErrUnexpectedEOF, "the agent's connection to the broker closed"},
		{status.Error(codes.Canceled, "context canceled"), "the agent stopped, or lost its connection to the broker"},
		{status.Error(codes.Unavailable, "read tcp 10.0.0.1:8443->10.0.0.7:42610: use of closed network connection"), "the agent's connection to the broker broke or closed"},
	} {
		got := AgentLoss(tc.err)
		if got != tc.want {
			t.Errorf("AgentLoss(%v) = %q, want %q", tc.err, got, tc.want)
		}
		if strings.Contains(got, "10.0.0.") {
			t.Errorf("AgentLoss(%v) = %q names an address", tc.err, got)
		}
	}
	// Words it has none for are the error's own, redacted.
	if got := AgentLoss(status.Error(codes.Internal, "lost at 10.0.0.7:42610")); strings.Contains(got, "10.0.0.7") {
		t.Errorf("AgentLoss of an unknown error = %q, names an address", got)
	}
}

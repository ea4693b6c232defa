package tunnel

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/splice"
)

// The caller's status when the agent's leg fails says why in words: Go's
// network errors name both ends of the agent's connection, which kcp's end
// users must not see.
func TestTheCallerHearsOfTheAgentsLossInWordsWithoutAddresses(t *testing.T) {
	readErr := &net.OpError{Op: "read", Net: "tcp",
		Source: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 8443},
		Addr:   &net.TCPAddr{IP: net.IPv4(10, 0, 0, 7), Port: 42610},
		Err:    fmt.Errorf("read: %w", syscall.ECONNRESET)}
	for _, tc := range []struct {
		err  error
		want string
	}{
		{readErr, "the agent's connection to the broker broke (connection reset by peer)"},
		{&net.OpError{Op: "read", Net: "tcp", Err: errors.New("use of closed network connection")}, "the agent's connection to the broker broke"},
		{io.ErrUnexpectedEOF, "the agent's connection to the broker closed"},
		{status.Error(codes.Canceled, "context canceled"), "the agent stopped, or lost its connection to the broker"},
		{context.Canceled, "the agent stopped, or lost its connection to the broker"},
		{status.Error(codes.Unavailable, "connection error: desc = \"transport: read tcp 10.0.0.1:8443->10.0.0.7:42610: read: broken pipe\""),
			"the agent's connection to the broker broke or closed"},
		{status.Error(codes.Unavailable, "transport is closing"), "the agent's connection to the broker broke or closed"},
		{status.Error(codes.Internal, "odd: 10.0.0.7:42610 said "+strings.Repeat("x", 400)), "odd: <address> said x"},
	} {
		callerStatus, _ := (&Tunnel{ID: "t-1"}).statuses(&splice.Failure{By: splice.B, Err: tc.err})
		msg := status.Convert(callerStatus).Message()
		if status.Code(callerStatus) != codes.Unavailable || !strings.HasPrefix(msg, "tunnel lost on the agent's side: "+tc.want) ||
			!strings.HasSuffix(msg, "(tunnel t-1)") {
			t.Errorf("%v: the caller hears %v, want Unavailable: tunnel lost on the agent's side: %s... (tunnel t-1)", tc.err, callerStatus, tc.want)
		}
		if strings.Contains(msg, "10.0.0.") || len(msg) > 512 {
			t.Errorf("%v: the caller hears %q: an address, or too long", tc.err, msg)
		}
	}
}

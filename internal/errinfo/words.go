package errinfo

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"syscall"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/redact"
)

// The words for errors of the network, by their type, never their text:
// what a status message says of a failure that Go's errors describe with
// addresses. Reasons (errinfo.go) say what failed; these say why, for
// people.

// ConnectFailure says in words why a connection failed (the agent's to a
// target, or its Tunnel stream as it opened), by the error's type, without
// the addresses that Go's errors name.
func ConnectFailure(err error) string {
	var errno syscall.Errno
	var dns *net.DNSError
	switch {
	case errors.As(err, &errno):
		return errno.Error() // "connection refused", "no route to host"
	case errors.As(err, &dns) && dns.IsNotFound:
		return "no such host"
	case errors.As(err, &dns):
		return "the name did not resolve"
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return "timed out"
	case errors.Is(err, context.Canceled):
		return "cancelled"
	case errors.Is(err, io.EOF):
		return "the target closed the connection"
	}
	if st, ok := status.FromError(err); ok {
		return "the broker's stream ended (" + st.Code().String() + ")"
	}
	return "the connection failed"
}

// maxLossText bounds what AgentLoss passes on of an error it has no words
// for.
const maxLossText = 256

// AgentLoss says in words why the agent's leg failed, by the error's type
// and status code, never its text: its connection to the broker broke or
// closed, its stream was cancelled (the agent stopped, or lost its
// connection), or, redacted, what else the leg's error says. Go's network
// errors name both ends of the agent's connection
// ("read tcp 10.0.0.1:8443->10.0.0.7:42610: ..."), which a caller must not
// see; gRPC passes a broken transport on as Unavailable, with the cause
// only in its text, which the broker's log keeps.
func AgentLoss(err error) string {
	var op *net.OpError
	var errno syscall.Errno
	switch {
	case errors.As(err, &errno):
		return "the agent's connection to the broker broke (" + errno.Error() + ")"
	case errors.As(err, &op), errors.Is(err, net.ErrClosed):
		return "the agent's connection to the broker broke"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "the agent's connection to the broker closed"
	case errors.Is(err, context.Canceled), status.Code(err) == codes.Canceled:
		return "the agent stopped, or lost its connection to the broker"
	case status.Code(err) == codes.Unavailable:
		return "the agent's connection to the broker broke or closed"
	}
	return redact.Text(status.Convert(err).Message(), maxLossText)
}

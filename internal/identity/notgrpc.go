package identity

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"

	"google.golang.org/grpc/credentials"
)

// ErrNotGRPC is a server that answered, but not as a gRPC server over TLS
// does: a client pointed at another port of the broker (its metrics port
// serves plain HTTP, its CONNECT port TLS without HTTP/2).
var ErrNotGRPC = errors.New("not a gRPC server over TLS")

// errNoHTTP2 is a server that completed a TLS handshake without picking
// "h2" by ALPN, which a gRPC server always does.
var errNoHTTP2 = errors.New("the server picked no application protocol by ALPN: it does not speak HTTP/2")

// requireHTTP2 refuses a server that picked no application protocol, after
// verify. gRPC refuses it too, after the handshake, but with an error only
// its text tells apart; here it is errNoHTTP2, for diagnoseNotGRPC. The
// server hears "bad certificate", crypto/tls's one alert for a refusal in
// VerifyConnection.
func requireHTTP2(verify func(tls.ConnectionState) error) func(tls.ConnectionState) error {
	return func(cs tls.ConnectionState) error {
		if err := verify(cs); err != nil {
			return err
		}
		if cs.NegotiatedProtocol == "" {
			return errNoHTTP2
		}
		return nil
	}
}

// diagnoseNotGRPC makes the error of a client handshake with a server
// that is no gRPC server over TLS say so (ErrNotGRPC), rather than "first
// record does not look like a TLS handshake" or "missing selected ALPN
// property", and name the port to use instead. creds must refuse a server
// without ALPN with errNoHTTP2 (requireHTTP2).
func diagnoseNotGRPC(creds credentials.TransportCredentials) credentials.TransportCredentials {
	return &notGRPCCreds{TransportCredentials: creds}
}

type notGRPCCreds struct {
	credentials.TransportCredentials
}

func (c *notGRPCCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if _, ok := errors.AsType[tls.RecordHeaderError](err); ok {
		return nil, nil, notGRPC(authority, "it does not speak TLS")
	}
	if errors.Is(err, errNoHTTP2) {
		return nil, nil, notGRPC(authority, "it speaks TLS, but not HTTP/2")
	}
	return conn, info, err
}

func (c *notGRPCCreds) Clone() credentials.TransportCredentials {
	return &notGRPCCreds{TransportCredentials: c.TransportCredentials.Clone()}
}

func notGRPC(authority, why string) error {
	return fmt.Errorf("%s answered, but %s: %w; is that the broker's --listen port, not its metrics or CONNECT port?", authority, why, ErrNotGRPC)
}

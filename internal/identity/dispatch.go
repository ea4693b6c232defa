package identity

import (
	"net"

	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Dispatch hands the server's connections whose handshake picked the ALPN
// protocol proto (offered with Protocols) to serve, in a goroutine of its
// own, and gives gRPC the others. serve owns the connection, verified as
// gRPC's are: its AuthInfo names the peer. Its Read returns io.EOF only
// for a TLS close_notify, and wire.ErrNoCloseNotify for a socket that
// ended without one (wire.CloseNotified). gRPC clears its handshake
// deadline on the connection as the handshake returns, so serve bounds its
// reads by other means than deadlines set at once.
func Dispatch(creds credentials.TransportCredentials, proto string, serve func(net.Conn, AuthInfo)) credentials.TransportCredentials {
	return &dispatcher{TransportCredentials: creds, proto: proto, serve: serve}
}

type dispatcher struct {
	credentials.TransportCredentials
	proto string
	serve func(net.Conn, AuthInfo)
}

func (d *dispatcher) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	// gRPC's connections read through the Socket too: it only notes
	// the socket's end.
	sock := &wire.Socket{Conn: raw}
	conn, info, err := d.TransportCredentials.ServerHandshake(sock)
	if err != nil {
		return nil, nil, err
	}
	if ai, ok := info.(AuthInfo); ok && ai.State.NegotiatedProtocol == d.proto {
		go d.serve(wire.CloseNotified(conn, sock), ai)
		// gRPC leaves a dispatched connection open, and only this exact
		// error means that: wrappers above must return it unchanged.
		return nil, nil, credentials.ErrConnDispatched
	}
	return conn, info, nil
}

func (d *dispatcher) Clone() credentials.TransportCredentials {
	return &dispatcher{TransportCredentials: d.TransportCredentials.Clone(), proto: d.proto, serve: d.serve}
}

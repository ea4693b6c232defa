package identity

import (
	"net"

	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Dispatch hands the server's connections whose handshake picked an ALPN
// protocol of serve (offered with Protocols) to that protocol's function,
// in a goroutine of its own, and gives gRPC the others. The function owns
// the connection, verified as gRPC's are: its AuthInfo names the peer. Its
// Read returns io.EOF only for a TLS close_notify, and
// wire.ErrNoCloseNotify for a socket that ended without one
// (wire.CloseNotified). gRPC clears its handshake deadline on the
// connection as the handshake returns, so the function bounds its reads by
// other means than deadlines set at once.
func Dispatch(creds credentials.TransportCredentials, serve map[string]func(net.Conn, AuthInfo)) credentials.TransportCredentials {
	return &dispatcher{TransportCredentials: creds, serve: serve}
}

type dispatcher struct {
	credentials.TransportCredentials
	serve map[string]func(net.Conn, AuthInfo)
}

func (d *dispatcher) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	// gRPC's connections read through the Socket too: it only notes
	// the socket's end.
	sock := &wire.Socket{Conn: raw}
	conn, info, err := d.TransportCredentials.ServerHandshake(sock)
	if err != nil {
		return nil, nil, err
	}
	ai, ok := info.(AuthInfo)
	if serve := d.serve[ai.State.NegotiatedProtocol]; ok && serve != nil {
		go serve(wire.CloseNotified(conn, sock), ai)
		// gRPC leaves a dispatched connection open, and only this exact
		// error means that: wrappers above must return it unchanged.
		return nil, nil, credentials.ErrConnDispatched
	}
	return conn, info, nil
}

func (d *dispatcher) Clone() credentials.TransportCredentials {
	return &dispatcher{TransportCredentials: d.TransportCredentials.Clone(), serve: d.serve}
}

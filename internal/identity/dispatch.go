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
// (wire.CloseNotified). gRPC clears the connection's deadline as the
// handshake returns, which would undo a deadline the function had set by
// then (a tunnel's end exchange, in a test's first milliseconds): on a
// server that serves a HandOver listener, the function runs once gRPC is
// done with the connection.
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
		handed := handingOver(raw)
		go func() {
			handed()
			serve(wire.CloseNotified(conn, sock), ai)
		}()
		// gRPC leaves a dispatched connection open, and only this exact
		// error means that: wrappers above must return it unchanged.
		return nil, nil, credentials.ErrConnDispatched
	}
	return conn, info, nil
}

func (d *dispatcher) Clone() credentials.TransportCredentials {
	return &dispatcher{TransportCredentials: d.TransportCredentials.Clone(), serve: d.serve}
}

package identity

import (
	"log/slog"
	"net"

	"google.golang.org/grpc/credentials"
)

// LogRefusedHandshakes logs every TLS handshake the server refuses. A refused
// peer sees only a TLS alert, so the server's log is where an operator learns
// why (unknown trust domain, expired SVID, no client certificate).
func LogRefusedHandshakes(c credentials.TransportCredentials, log *slog.Logger) credentials.TransportCredentials {
	return &refusalLogger{TransportCredentials: c, log: log}
}

type refusalLogger struct {
	credentials.TransportCredentials
	log *slog.Logger
}

func (r *refusalLogger) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	c, info, err := r.TransportCredentials.ServerHandshake(conn)
	if err != nil {
		r.log.Warn("TLS handshake refused", "remote", conn.RemoteAddr().String(), "error", err)
	}
	return c, info, err
}

func (r *refusalLogger) Clone() credentials.TransportCredentials {
	return &refusalLogger{TransportCredentials: r.TransportCredentials.Clone(), log: r.log}
}

package identity

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"

	"google.golang.org/grpc/credentials"
)

// Nothing a peer sends may crash the process. A handshake runs code that a
// peer's certificate reaches (crypto/tls, x509, go-spiffe, the authorizer),
// and a bug there must fail only that handshake, as ReasonInternal, with
// its stack logged, since it is a bug to fix. On the client, gRPC runs
// crypto/tls on a goroutine of its own, where no wrapper can recover: there
// only what crypto/tls calls back (the verification) is guarded.

// handshakePanic is a panic caught during a handshake, with where it
// happened.
type handshakePanic struct {
	value any
	stack []byte
}

func (p *handshakePanic) Error() string { return fmt.Sprintf("TLS handshake panicked: %v", p.value) }

func panicked(value any) error {
	return refused(ReasonInternal, &handshakePanic{value: value, stack: debug.Stack()})
}

// withoutPanics is verify failing, rather than panicking, when the code it
// calls panics. It is for code gRPC runs on a goroutine of its own, out of
// guardPanics' reach: the client's handshake.
func withoutPanics(verify func(tls.ConnectionState) error) func(tls.ConnectionState) error {
	return func(cs tls.ConnectionState) (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = panicked(r)
			}
		}()
		return verify(cs)
	}
}

// guardPanics makes a panic during one of creds' handshakes that
// handshake's error, and logs its stack to the refusals' log. It logs the
// panics withoutPanics caught too, whose stacks it finds in the error.
func guardPanics(creds credentials.TransportCredentials, refusals *Refusals) credentials.TransportCredentials {
	g := &panicGuard{TransportCredentials: creds}
	if refusals != nil {
		g.log = refusals.Log
	}
	return g
}

type panicGuard struct {
	credentials.TransportCredentials
	log *slog.Logger
}

func (g *panicGuard) ServerHandshake(raw net.Conn) (conn net.Conn, info credentials.AuthInfo, err error) {
	defer g.catch(&err)
	return g.TransportCredentials.ServerHandshake(raw)
}

func (g *panicGuard) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (conn net.Conn, info credentials.AuthInfo, err error) {
	defer g.catch(&err)
	return g.TransportCredentials.ClientHandshake(ctx, authority, raw)
}

// catch turns a panic into *err, and logs the stack of any panic *err
// holds. A handshake that panicked has returned no connection; its caller
// closes the raw one, as after any failed handshake.
func (g *panicGuard) catch(err *error) {
	if r := recover(); r != nil {
		*err = panicked(r)
	}
	if p, ok := errors.AsType[*handshakePanic](*err); ok && g.log != nil {
		g.log.Error("TLS handshake panicked", "panic", p.value, "stack", string(p.stack))
	}
}

func (g *panicGuard) Clone() credentials.TransportCredentials {
	return &panicGuard{TransportCredentials: g.TransportCredentials.Clone(), log: g.log}
}

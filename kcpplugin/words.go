package kcpplugin

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"os"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// What kcpplugin says in words about a failed connection to a broker: the
// one place it turns errors into words. kcp shows a dial's error to its end
// users, who get the words, never the broker's address, which Go's errors
// name ("dial tcp 10.96.0.7:8443: connect: connection refused").
//
// gRPC passes a connection's failure on to a waiting stream only as text,
// in its picker's status. So DialOptions records the failure itself, with
// its type, where it happens: its dialer (connRecord.dial), its
// credentials (recordingCreds) and the first bytes after the handshake
// (firstBytes; a TLS 1.3 server's refusal of the client's certificate
// arrives there, which wire.AwaitServer makes part of the handshake); a
// stream interceptor (connRecord.stream) hands the record to the stream's
// error, and connectionFailure reads it with errors.As and errors.Is.

// stage is where a connection to a broker failed.
type stage int

const (
	stageDial       stage = iota // connecting, TCP
	stageHandshake               // the TLS handshake
	stageFirstBytes              // the first bytes after the handshake
)

// connFailure is a connection's failure and where it happened.
type connFailure struct {
	err   error
	stage stage
}

// connRecord is the last failure of a ClientConn's connections to its
// brokers, nil once one succeeded (its first bytes arrived).
type connRecord struct {
	mu   sync.Mutex
	last *connFailure
}

func (r *connRecord) set(f *connFailure) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.last = f
}

func (r *connRecord) get() *connFailure {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last
}

// options are the options that record r: the dialer, creds wrapped, and
// the interceptor. The dialer replaces gRPC's own, so gRPC does not send
// the connection through a proxy of the environment (HTTPS_PROXY) either:
// the broker is kcp's peer in the cluster, as for the webhook client
// (webhook.go).
func (r *connRecord) options(creds credentials.TransportCredentials) []grpc.DialOption {
	return append(wire.DialOptions(recordingCreds{wire.AwaitServer(creds), r}),
		grpc.WithContextDialer(r.dial), grpc.WithChainStreamInterceptor(r.stream))
}

// dial is gRPC's dialer, as gRPC's own dials (TCP, or a Unix socket for a
// unix: target, which gRPC passes with its scheme), recording its failure.
func (r *connRecord) dial(ctx context.Context, addr string) (net.Conn, error) {
	network := "tcp"
	if path, ok := strings.CutPrefix(addr, "unix:"); ok {
		network, addr = "unix", strings.TrimPrefix(path, "//")
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil && ctx.Err() != context.Canceled {
		r.set(&connFailure{err, stageDial})
	}
	return c, err
}

// stream hands the record to the error of a stream that could not start:
// the error stays the same status, with the record behind it.
func (r *connRecord) stream(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	s, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		if f := r.get(); f != nil {
			return nil, &recordedError{err, f}
		}
	}
	return s, err
}

// recordedError is a stream's error with the last failure of its
// ClientConn's connections.
type recordedError struct {
	error
	conn *connFailure
}

// GRPCStatus is the stream's status, unchanged.
func (e *recordedError) GRPCStatus() *status.Status { return status.Convert(e.error) }

func (e *recordedError) Unwrap() []error { return []error{e.error, e.conn.err} }

// recordingCreds are a connection's credentials (which await a TLS 1.3
// server's first bytes, wire.AwaitServer), recording why its handshake
// failed, and its first bytes after (firstBytes).
type recordingCreds struct {
	credentials.TransportCredentials
	record *connRecord
}

func (c recordingCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, raw)
	if err != nil {
		if ctx.Err() != context.Canceled {
			at := stageHandshake
			var first *wire.FirstBytesError
			if errors.As(err, &first) {
				at = stageFirstBytes
			}
			c.record.set(&connFailure{err, at})
		}
		return conn, info, err
	}
	fb := &firstBytes{Conn: conn, record: c.record}
	if wire.AwaitedServer(info) {
		// The server's first bytes have come: the connection succeeded.
		fb.exchanged(true, nil)
	}
	return fb, info, nil
}

func (c recordingCreds) Clone() credentials.TransportCredentials {
	return recordingCreds{c.TransportCredentials.Clone(), c.record}
}

// firstBytes is a connection after its handshake, recording why it failed
// until its first bytes arrive (under TLS 1.3, within the handshake). Then
// the connection succeeded, and the record is cleared.
type firstBytes struct {
	net.Conn
	record *connRecord
	done   atomic.Bool
}

func (c *firstBytes) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if !c.done.Load() {
		c.exchanged(n > 0, err)
	}
	return n, err
}

func (c *firstBytes) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if err != nil && !c.done.Load() {
		c.exchanged(false, err)
	}
	return n, err
}

func (c *firstBytes) exchanged(read bool, err error) {
	switch {
	case read:
		if c.done.CompareAndSwap(false, true) {
			c.record.set(nil)
		}
	case err != nil && !errors.Is(err, net.ErrClosed):
		c.record.set(&connFailure{err, stageFirstBytes})
	}
}

// connectionFailure says in words why gRPC could not connect to a broker,
// for err, the error of a stream that waited for a connection: by the
// failure DialOptions recorded, or, for a ClientConn built without
// DialOptions (or whose options replaced its dialer or credentials, or a
// name that did not resolve, which gRPC's resolver reports only as text),
// by the text of gRPC's status (failureInText). Whatever it has no words for
// is "cannot connect".
func connectionFailure(err error) string {
	var rec *recordedError
	if errors.As(err, &rec) {
		return failureInWords(rec.conn)
	}
	return failureInText(status.Convert(err).Message())
}

// failureInWords says why a connection failed, by the error's type.
func failureInWords(f *connFailure) string {
	alert, remote := remoteAlert(f.err)
	switch {
	case f.stage == stageHandshake, remote:
		why := ""
		switch {
		case remote:
			why = "the broker refused it"
			if name, ok := certificateAlerts[alert]; ok {
				why = "the broker refused this client's certificate (" + name + ")"
			}
		default:
			why = refusedBrokerCertificate(f.err)
		}
		if why != "" {
			return "TLS handshake failed: " + why
		}
		return "TLS handshake failed"
	}
	var dns *net.DNSError
	var errno syscall.Errno
	var timeout interface{ Timeout() bool }
	switch {
	case errors.As(f.err, &dns):
		return "no such host: the broker's name does not resolve"
	case errors.Is(f.err, os.ErrDeadlineExceeded), errors.Is(f.err, context.DeadlineExceeded),
		errors.As(f.err, &timeout) && timeout.Timeout():
		return "connecting timed out"
	case errors.As(f.err, &errno):
		switch errno {
		case syscall.ECONNREFUSED:
			return "connection refused"
		case syscall.ECONNRESET:
			return "connection reset"
		case syscall.EPIPE:
			return "the broker closed the connection"
		case syscall.EHOSTUNREACH:
			return "no route to host"
		case syscall.ENETUNREACH:
			return "network is unreachable"
		case syscall.ETIMEDOUT:
			return "connecting timed out"
		}
	case errors.Is(f.err, io.EOF), errors.Is(f.err, io.ErrUnexpectedEOF):
		return "the broker closed the connection"
	}
	return "cannot connect"
}

// certificateAlerts are the TLS alerts with which a server refuses a
// client's certificate, by their names in RFC 8446 as crypto/tls words
// them.
var certificateAlerts = map[uint8]string{
	42:  "bad certificate",
	43:  "unsupported certificate",
	44:  "revoked certificate",
	45:  "expired certificate",
	46:  "unknown certificate",
	48:  "unknown certificate authority",
	116: "certificate required",
}

// remoteAlert is the alert the broker sent, if err is one: crypto/tls
// returns it as a *net.OpError with Op "remote error" whose Err is its
// unexported alert type, a uint8.
func remoteAlert(err error) (uint8, bool) {
	var op *net.OpError
	if !errors.As(err, &op) || op.Op != "remote error" || op.Err == nil {
		return 0, false
	}
	if v := reflect.ValueOf(op.Err); v.Kind() == reflect.Uint8 {
		return uint8(v.Uint()), true
	}
	return 0, false
}

// refusedBrokerCertificate says why this client refused the broker's
// certificate, if it did.
func refusedBrokerCertificate(err error) string {
	var invalid x509.CertificateInvalidError
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	var verify *tls.CertificateVerificationError
	var sent tls.AlertError // the alert this client sent: it refused the handshake
	switch {
	case errors.As(err, &invalid) && invalid.Reason == x509.Expired:
		return "the broker's certificate has expired, or this client's clock is wrong"
	case errors.As(err, &invalid), errors.As(err, &unknown), errors.As(err, &host), errors.As(err, &verify), errors.As(err, &sent):
		return "the broker's certificate was not accepted"
	}
	return ""
}

// failureInText says why gRPC could not connect, from the text of its last
// connection error in msg: only for what DialOptions did not record (see
// connectionFailure).
func failureInText(msg string) string {
	switch {
	case strings.Contains(msg, "authentication handshake failed"), strings.Contains(msg, "remote error: tls: "):
		if why := handshakeFailure(msg); why != "" {
			return "TLS handshake failed: " + why
		}
		return "TLS handshake failed"
	case strings.Contains(msg, "no such host"), strings.Contains(msg, "produced zero addresses"),
		strings.Contains(msg, "server misbehaving"):
		return "no such host: the broker's name does not resolve"
	case strings.Contains(msg, "connection refused"):
		return "connection refused"
	case strings.Contains(msg, "connection reset"):
		return "connection reset"
	case strings.Contains(msg, "broken pipe"):
		return "the broker closed the connection"
	case strings.Contains(msg, "no route to host"):
		return "no route to host"
	case strings.Contains(msg, "network is unreachable"):
		return "network is unreachable"
	case strings.Contains(msg, "i/o timeout"), strings.Contains(msg, "timed out"), strings.Contains(msg, "deadline exceeded"):
		return "connecting timed out"
	case strings.Contains(msg, "EOF"):
		return "the broker closed the connection"
	}
	return "cannot connect"
}

// handshakeFailure says which side refused a TLS handshake, if the
// message tells.
func handshakeFailure(msg string) string {
	const remote = "remote error: tls: "
	if i := strings.Index(msg, remote); i >= 0 {
		alert := msg[i+len(remote):]
		for _, a := range []string{"bad certificate", "expired certificate", "unknown certificate authority", "unknown certificate", "certificate required"} {
			if strings.HasPrefix(alert, a) {
				return "the broker refused this client's certificate (" + a + ")"
			}
		}
		return "the broker refused it"
	}
	switch {
	case strings.Contains(msg, "expired"):
		return "the broker's certificate has expired, or this client's clock is wrong"
	case strings.Contains(msg, "x509"), strings.Contains(msg, "verif"), strings.Contains(msg, "certificate"),
		strings.Contains(msg, "SPIFFE"), strings.Contains(msg, "spiffe"):
		return "the broker's certificate was not accepted"
	}
	return ""
}

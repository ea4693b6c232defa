package identity

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc/credentials"
)

// Reason says in one word why a TLS handshake failed. The set is small and
// fixed, so that it can label a metric.
type Reason string

// Every Reason; Reasons lists them.
const (
	// ReasonNoCertificate: the peer presented no certificate.
	ReasonNoCertificate Reason = "no_certificate"
	// ReasonUntrusted: the chain does not lead to a bundle the process
	// holds (unknown CA or trust domain, bad signature, not yet valid).
	ReasonUntrusted Reason = "untrusted"
	// ReasonExpired: a certificate of the chain has expired.
	ReasonExpired Reason = "expired"
	// ReasonInvalidID: the leaf carries no SPIFFE ID a workload may hold.
	ReasonInvalidID Reason = "invalid_id"
	// ReasonUnauthorized: a valid SVID, but not the ID this side expects.
	ReasonUnauthorized Reason = "unauthorized"
	// ReasonPeerRefused: the peer refused this side's certificate.
	ReasonPeerRefused Reason = "refused_by_peer"
	// ReasonTimeout: the handshake did not finish in time.
	ReasonTimeout Reason = "timeout"
	// ReasonOverLimit: too many handshakes at once (MaxConcurrentHandshakes).
	ReasonOverLimit Reason = "over_limit"
	// ReasonClosed: the peer closed the connection before the end.
	ReasonClosed Reason = "closed"
	// ReasonProtocol: anything else TLS refused: not TLS, no common
	// version, cipher or protocol.
	ReasonProtocol Reason = "protocol"
	// ReasonInternal: the handshake panicked (a bug, caught).
	ReasonInternal Reason = "internal"
)

// Reasons is every Reason, e.g. to set a metric's series to zero.
var Reasons = []Reason{
	ReasonNoCertificate, ReasonUntrusted, ReasonExpired, ReasonInvalidID, ReasonUnauthorized,
	ReasonPeerRefused, ReasonTimeout, ReasonOverLimit, ReasonClosed, ReasonProtocol, ReasonInternal,
}

// RefusedError is a handshake this package refused, with its reason.
type RefusedError struct {
	Reason Reason
	Err    error
}

func (e *RefusedError) Error() string { return e.Err.Error() }
func (e *RefusedError) Unwrap() error { return e.Err }

func refused(r Reason, err error) error { return &RefusedError{Reason: r, Err: err} }

// ReasonOf names why a handshake failed.
func ReasonOf(err error) Reason {
	var r *RefusedError
	var op *net.OpError
	switch {
	case errors.As(err, &r):
		return r.Reason
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return ReasonTimeout
	case errors.As(err, &op) && op.Op == "remote error":
		// crypto/tls reports an alert from the peer so.
		return ReasonPeerRefused
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed),
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return ReasonClosed
	}
	return ReasonProtocol
}

// Refusals is where failed handshakes are reported: each is counted, and
// logged at most a few times a second. A peer that fails a handshake sees
// only a TLS alert, so the log is where an operator learns why; but junk
// connections must not flood it.
type Refusals struct {
	// Log gets a warning per refused handshake, at most PerSecond a
	// second; past that, one line a second says how many were left out,
	// by reason.
	Log       *slog.Logger
	PerSecond int
	// Count, if set, is called for every refused handshake.
	Count func(Reason)

	// now is time.Now, except in tests.
	now func() time.Time

	mu       sync.Mutex
	window   time.Time // start of the current second
	logged   int       // lines logged in it
	held     map[Reason]int
	flushing bool
}

// DefaultRefusalLogsPerSecond bounds the warnings about refused handshakes.
const DefaultRefusalLogsPerSecond = 5

// report counts and perhaps logs one failed handshake.
func (r *Refusals) report(remote string, err error) {
	if r == nil {
		return
	}
	reason := ReasonOf(err)
	if r.Count != nil {
		r.Count(reason)
	}
	if r.Log == nil || !r.admit(reason) {
		return
	}
	if reason == ReasonPeerRefused {
		// The refusal is the peer's: say so, lest it read as this side's.
		r.Log.Warn("TLS handshake refused by the peer: its log says why", "remote", remote, "reason", string(reason), "error", err)
		return
	}
	r.Log.Warn("TLS handshake refused", "remote", remote, "reason", string(reason), "error", err)
}

// admit says whether a line may be logged now, and holds it back if not.
func (r *Refusals) admit(reason Reason) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.clock()
	if now.Sub(r.window) >= time.Second {
		r.window, r.logged = now, 0
	}
	perSecond := r.PerSecond
	if perSecond <= 0 {
		perSecond = DefaultRefusalLogsPerSecond
	}
	if r.logged < perSecond {
		r.logged++
		return true
	}
	if r.held == nil {
		r.held = map[Reason]int{}
	}
	r.held[reason]++
	if !r.flushing {
		r.flushing = true
		time.AfterFunc(r.window.Add(time.Second).Sub(now), r.flush)
	}
	return false
}

// flush says how many lines were held back.
func (r *Refusals) flush() {
	r.mu.Lock()
	held := r.held
	r.held, r.flushing = nil, false
	r.mu.Unlock()
	total := 0
	attrs := make([]any, 0, len(held))
	for _, reason := range Reasons {
		if n := held[reason]; n > 0 {
			total += n
			attrs = append(attrs, slog.Int(string(reason), n))
		}
	}
	r.Log.Warn("more TLS handshakes refused, not logged one by one", "suppressed", total, slog.Group("by_reason", attrs...))
}

func (r *Refusals) clock() time.Time {
	if r.now != nil {
		return r.now()
	}
	return time.Now()
}

// reportRefusals reports each of creds' failed handshakes to r; with no r
// it is creds.
func reportRefusals(creds credentials.TransportCredentials, r *Refusals) credentials.TransportCredentials {
	if r == nil {
		return creds
	}
	return &reportingCreds{TransportCredentials: creds, refusals: r}
}

type reportingCreds struct {
	credentials.TransportCredentials
	refusals *Refusals
}

func (c *reportingCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	// Read before the handshake, which closes raw when it fails.
	remote := raw.RemoteAddr().String()
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		c.refusals.report(remote, err)
	}
	return conn, info, err
}

func (c *reportingCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, raw)
	// gRPC cancels handshakes when the connection is no longer wanted:
	// that refuses nothing.
	if err != nil && ctx.Err() != context.Canceled {
		c.refusals.report(authority, err)
	}
	return conn, info, err
}

// Clone shares the Refusals: its log's rate is the process's.
func (c *reportingCreds) Clone() credentials.TransportCredentials {
	return &reportingCreds{TransportCredentials: c.TransportCredentials.Clone(), refusals: c.refusals}
}

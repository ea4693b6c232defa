// Package fragments closes the broker's connections whose peers send their
// data in fragments: HTTP/2 DATA frames too small to carry a whole gRPC
// message, or padded.
//
// Why: gRPC's server keeps every DATA frame it receives as a buffer of its
// own, the frame's whole payload and some 40-50 bytes more, and a stream's
// handler holds those of a message until the message is whole. HTTP/2's
// flow control counts bytes of data, not frames, and gRPC returns padding
// to the sender's window at once. So a peer that sends a message in 1-byte
// frames, or in 8-byte frames padded with 255 bytes, makes the broker hold
// some 40 times what it sends: about 1.1 MiB for an unfinished message of
// 32 KiB, on every stream it has, for as long as it keeps the message
// unfinished; and about 11 MiB for each tunnel whose caller does not read
// (gRPC compacts the buffers a handler has not asked for yet, into pooled
// buffers up to twice their size). Measured with tunnelbench -phases
// hostile -hostile-frame 1 (or -hostile-frame 8 -hostile-pad 255).
//
// No gRPC sender does that: grpc-go puts the 5-byte prefix of a message and
// its first bytes in one frame, fills every frame but a message's last as
// far as the frame size and the receiver's windows allow, and never pads,
// so that it sends a frame of fewer than MinData bytes of data only where a
// window stops it (see Share). Refuse wraps the broker's transport
// credentials so that it reads the frame headers of every connection as they
// go by, and closes a connection once its fragments (tally.go) make gRPC
// hold more than Floor plus one byte per Share bytes of data received: after
// about a thousand 1-byte frames. Its peer gets an HTTP/2 GOAWAY saying why
// (ENHANCE_YOUR_CALM), which gRPC clients report with the status of their
// calls (Unavailable).
//
// What remains: in frames of MinData bytes or more, an unfinished message
// of 32 KiB costs about 0.4 MiB (the opening bounds and the tunnel limits
// bound how many there are), and a tunnel whose caller does not read holds
// its 1 MiB window in whole 8-byte messages at about 9 MiB, against about
// 1.2 MiB in large messages.
package fragments

import (
	"fmt"
	"log/slog"
	"net"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
)

// Report is where Refuse reports the connections it closes.
type Report struct {
	// Log gets a warning for each, at most LogsPerSecond a second past the
	// first few; each line says how many were closed in all.
	Log *slog.Logger
	// Count, if set, is called for each (a metric).
	Count func()
}

// LogsPerSecond bounds the warnings about closed connections.
const LogsPerSecond = 5

// Refuse wraps a server's transport credentials (TLS) so that each
// connection they secure is closed once its peer sends data in fragments,
// past its allowance. Everything else is the wrapped credentials': the
// handshake, the AuthInfo, Info, Clone. Install it outermost, so that it
// sees the bytes gRPC reads and writes.
func Refuse(creds credentials.TransportCredentials, report Report) credentials.TransportCredentials {
	return &refusingCreds{TransportCredentials: creds, guard: &guard{
		report: report,
		logs:   &rate.Sometimes{First: LogsPerSecond, Interval: time.Second / LogsPerSecond},
	}}
}

type refusingCreds struct {
	credentials.TransportCredentials
	guard *guard
}

func (c *refusingCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		return conn, info, err
	}
	return c.guard.watch(conn, info), info, nil
}

func (c *refusingCreds) Clone() credentials.TransportCredentials {
	return &refusingCreds{TransportCredentials: c.TransportCredentials.Clone(), guard: c.guard}
}

// guard is shared by the connections of one server.
type guard struct {
	report Report
	logs   *rate.Sometimes
	closed atomic.Int64
}

// closing reports a connection being closed for t.
func (g *guard) closing(c *conn, t tally) {
	n := g.closed.Add(1)
	if g.report.Count != nil {
		g.report.Count()
	}
	if g.report.Log == nil {
		return
	}
	g.logs.Do(func() {
		g.report.Log.Warn("closing a connection whose peer sends its data in fragments",
			"peer", c.peer, "remote", c.RemoteAddr().String(),
			"fragments", t.fragments, "fragment_bytes", t.cost, "data_bytes", t.data,
			"closed_in_all", n)
	})
}

// peerName names the peer of a connection in logs: its SPIFFE ID.
func peerName(info credentials.AuthInfo) string {
	if info == nil {
		return ""
	}
	if id, ok := info.(identity.AuthInfo); ok && !id.ID.IsZero() {
		return id.ID.String()
	}
	return fmt.Sprintf("(%s)", info.AuthType())
}

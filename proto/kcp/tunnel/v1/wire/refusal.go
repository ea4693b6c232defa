package wire

import (
	"io"
	"net"
	"time"
)

// The bounds of what CloseRefused reads after a refusal: the caller's
// first bytes, which it may send right behind its dial without waiting for
// the answer (an HTTP request, a TLS ClientHello that did not fit in the
// early data), take a few KiB; a peer that goes on sending past them, or
// never closes, is closed after the bound as before. At most MaxLingering
// connections linger at once in a process; past that a refused connection
// is closed at once, as if it had sent nothing more, so that peers who
// make the broker refuse them over and over cost it no more than that.
const (
	RefusalLinger = time.Second
	RefusalDrain  = 64 << 10
	MaxLingering  = 256
)

// lingering holds a place for each connection CloseRefused is reading.
var lingering = make(chan struct{}, MaxLingering)

// CloseRefused closes a data or dial connection whose last message, a
// refusal, has just been written. It sends a close_notify, then reads and
// drops what the peer sent after its dial or open, until the peer closes,
// RefusalDrain bytes have come or RefusalLinger has passed, and only then
// closes the socket (at once while MaxLingering others linger). A socket
// closed with bytes unread sends a TCP reset, and a peer that receives the
// reset before it has read the refusal loses the refusal with it: it reads
// "connection reset" instead of why (docs/protocol.md §3.5, §3.6).
//
// The linger is bounded by a timer that closes conn rather than by a read
// deadline, which gRPC clears on the socket just after it has handed the
// connection over.
func CloseRefused(conn net.Conn) {
	select {
	case lingering <- struct{}{}:
		defer func() { <-lingering }()
	default:
		conn.Close()
		return
	}
	if cw, ok := conn.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	timer := time.AfterFunc(RefusalLinger, func() { conn.Close() })
	defer timer.Stop()
	_, _ = io.CopyN(io.Discard, conn, RefusalDrain)
	conn.Close()
}

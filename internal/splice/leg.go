package splice

import (
	"context"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// Leg is one end of a splice, at the level of data frames. The splice
// reads each leg in one goroutine and writes it in one other.
//
// The kinds of leg: a gRPC stream the broker serves (ServerStreamLeg: a
// caller's Dial, an agent's Tunnel), a gRPC stream the agent opened
// (ClientStreamLeg: its Tunnel to the broker), and a connection that
// carries the bytes as they are (ConnLeg: a CONNECT caller's, an agent's
// target).
type Leg interface {
	// Recv receives the peer's next frame into f, which then owns its
	// buffers. It returns io.EOF once the peer has half-closed.
	Recv(f *wire.Frame) error
	// Send sends the data frame f to the peer, and takes its buffers.
	Send(f *wire.Frame) error
	// CloseWrite tells the peer that the other leg's peer half-closed: it
	// will be sent nothing more.
	CloseWrite() error
	// Context ends when the peer has gone: its stream ended, or the leg
	// was ended.
	Context() context.Context
	// End ends the leg with the splice's status for it (nil: a clean
	// end). Recv and Send blocked on the leg return soon after: a
	// connection closes at once (a TCP reset for a failure), a stream the
	// broker serves ends when its handler, waiting for this, returns the
	// status, and a stream the agent opened is cancelled.
	End(status error)
}

// The kinds of leg.
var (
	_ Leg = (*ServerStreamLeg)(nil)
	_ Leg = (*ClientStreamLeg)(nil)
	_ Leg = (*ConnLeg)(nil)
)

package fragments

import "golang.org/x/net/http2"

// The allowance of one connection.
const (
	// MinData is the least data of a DATA frame that carries a whole gRPC
	// message of the protocol: its 5-byte prefix, a field's tag and length,
	// and a byte of payload. (Empty messages, 5 bytes, are the requests of
	// unary calls, which end their stream.)
	MinData = 8
	// PerFrame is what gRPC holds for a frame besides its payload, rounded
	// up: 40-50 bytes, measured.
	PerFrame = 64
	// Floor is what fragments may cost on any connection: about a thousand
	// 1-byte frames.
	Floor = 64 << 10
	// Share is the data per byte that fragments may cost beyond Floor.
	// gRPC's senders cut a message short only where the receiver's window
	// stops them: at most two fragments (the piece before the stop and the
	// rest after it) per window update of the broker, which sends one per
	// 256 KiB a stream's handler has read (a quarter of its 1 MiB window;
	// 16 KiB with --window-size -1), each costing at most 7 + PerFrame
	// bytes: at most one byte per 115 of data.
	Share = 64
)

// tally counts a connection's DATA frames against its allowance.
type tally struct {
	data      int64 // bytes of data received, padding excluded
	fragments int64
	cost      int64 // what the fragments made gRPC hold: payload and PerFrame each
}

// add counts a DATA frame f that carries data bytes of data, and says
// whether the connection is over its allowance.
func (t *tally) add(f http2.FrameHeader, data uint32) (over bool) {
	t.data += int64(data)
	if !isFragment(f, data) {
		return false
	}
	t.fragments++
	t.cost += int64(f.Length) + PerFrame
	return t.cost > t.allowance()
}

// allowance is what fragments may cost so far.
func (t *tally) allowance() int64 { return Floor + t.data/Share }

// isFragment says whether gRPC must hold more for f than it carries, so
// that a peer that sends its data so multiplies what it makes the broker
// hold. A frame of fewer than MinData bytes of data holds no whole message
// of the protocol. A padded frame makes gRPC hold its padding as well,
// while gRPC returns the padding to the peer's window at once; no gRPC
// client pads. A frame without data is dropped at once, and one that ends
// its stream is the last of its stream.
func isFragment(f http2.FrameHeader, data uint32) bool {
	if data == 0 || f.Flags.Has(http2.FlagDataEndStream) {
		return false
	}
	return data < MinData || f.Flags.Has(http2.FlagDataPadded)
}

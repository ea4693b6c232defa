package wire

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

// The transport settings kcp (kcpplugin), the broker and the agent share.
const (
	// MaxFrame is the largest data frame any sender makes; larger writes
	// are split. Frames well below gRPC's 4 MiB message limit keep latency
	// low for the other tunnels of a connection. It is 16 bytes under
	// 32 KiB so that an encoded frame (tag, length, payload) fits gRPC's
	// 32 KiB buffer class: one byte more and every encode and decode takes,
	// and clears, a 1 MiB buffer, a third of the CPU of a bulk transfer.
	MaxFrame = 32<<10 - 16
	// MaxMessageSize fits the largest message a sender of the protocol
	// makes: a data frame of MaxFrame bytes with its tag and length, or a
	// Register of at most the clusters an agent sends in one message.
	MaxMessageSize = 32 << 10
	// MaxEarlyData bounds the early data a dial carries with its target
	// (DialRequest.early_data) and its order (DialOrder.early_data): a TLS
	// ClientHello, 0.3-2 KiB, fits many times over, and a dial's first
	// message with its target stays well inside MaxMessageSize. A pending
	// dial holds no more than this in the broker.
	MaxEarlyData = 16 << 10
	// WriteBufferSize is gRPC's write buffer per connection (gRPC's
	// default is 32 KiB). gRPC writes it out when it is full or has nothing
	// more to send, so in bulk transfers one flush carries 16 TLS records,
	// which the broker and the agent send with one syscall
	// (internal/coalesce). gRPC lends the buffer
	// from a pool only while it holds data, so idle connections cost
	// nothing more.
	WriteBufferSize = 256 << 10
	// WindowSize is the fixed HTTP/2 flow-control window of each stream
	// (each tunnel), and ConnWindowSize that of a connection. gRPC's
	// dynamic windows send a PING with nearly every message of ping-pong
	// traffic (webhook calls), costing a write and a wakeup per message; a
	// fixed window does not. 1 MiB carries 20 MiB/s per tunnel at 50 ms
	// RTT, and bounds what a stalled reader leaves buffered in the broker.
	WindowSize     = 1 << 20
	ConnWindowSize = 16 * WindowSize
)

// DialOptions are the transport settings of a client's connection to the
// broker: creds (SPIFFE mTLS), the write buffer and fixed windows.
func DialOptions(creds credentials.TransportCredentials) []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithWriteBufferSize(WriteBufferSize),
		grpc.WithInitialWindowSize(WindowSize),
		grpc.WithInitialConnWindowSize(ConnWindowSize),
	}
}

// ServerOptions are the broker's side of the same settings: the write
// buffer, Frame
// streams, and fixed windows of window bytes per stream and 16 times that
// per connection. A window of zero or less leaves gRPC's dynamic windows.
func ServerOptions(window int32) []grpc.ServerOption {
	opts := []grpc.ServerOption{grpc.WriteBufferSize(WriteBufferSize), FrameServerOption()}
	if window > 0 {
		opts = append(opts, grpc.InitialWindowSize(window), grpc.InitialConnWindowSize(16*window))
	}
	return opts
}

// Package wire is how the three parties of a tunnel (kcp through kcpplugin,
// the broker and the syncer agent) carry the kcp.tunnel.v1 messages on
// gRPC: the frame codec, which receives data frames into gRPC's buffers
// and forwards them without decoding (Frame, FrameCodec), the transport
// settings all three use (DialOptions, ServerOptions, MaxFrame,
// MaxEarlyData), and the clients' wait for a TLS 1.3 server's first bytes
// (AwaitServer). No connection runtime lives here: the broker's and the
// agent's legs, splice and read buffers (internal/splice) and write
// coalescing (internal/coalesce) are the root module's.
//
// It imports only the standard library, gRPC and protobuf, so that the
// broker and the agent use it without linking kcpplugin (the webhook
// plugin's Kubernetes packages), and kcp gets it with the wire API it
// already requires.
package wire

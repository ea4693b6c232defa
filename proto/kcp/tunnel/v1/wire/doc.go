// Package wire is how the three parties of a tunnel (kcp through kcpplugin,
// the broker and the syncer agent) carry the kcp.tunnel.v1 messages: write
// coalescing under TLS, the transport settings all three use, the messages
// and frames of data and dial connections (a tunnel's end at the caller or
// the agent is a Leg), and the pool of spare connections (Spares) the
// agent and kcp open ahead of use and reuse.
//
// It imports only the standard library, gRPC and protobuf, so that the
// broker and the agent use it without linking kcpplugin (the webhook
// plugin's Kubernetes packages), and kcp gets it with the wire API it
// already requires.
package wire

package kcpplugin

import (
	"google.golang.org/grpc/credentials"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// CoalesceWrites wraps the transport credentials of kcp's connection to the
// broker so that each write gRPC makes reaches the socket in one write
// syscall, instead of one per TLS record (16 KiB): in bulk transfers those
// syscalls cost about a third of the CPU. Use it with a larger write buffer:
//
//	grpc.WithTransportCredentials(kcpplugin.CoalesceWrites(creds)),
//	grpc.WithWriteBufferSize(256<<10),
//
// It is wire.CoalesceWrites; the handshake and AuthInfo stay the wrapped
// credentials'. The broker and the agent wrap theirs the same way.
func CoalesceWrites(creds credentials.TransportCredentials) credentials.TransportCredentials {
	return wire.CoalesceWrites(creds)
}

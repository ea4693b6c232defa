// Package abortable ends an RPC from outside its handler.
//
// grpc-go frees a server stream's blocked Recv and Send only when the stream
// ends, and a stream ends when its handler returns. A tunnel is two streams
// with one handler copying on each; when one side fails, the handler of the
// other may sit in Recv for as long as its peer stays silent. End writes the
// RPC's status from any goroutine, which ends the stream there and then: the
// peer gets that status, and the handler's blocked calls return. The first
// failure of a tunnel so frees both handlers whatever the peers do, without
// a watcher goroutine per tunnel.
//
// grpc-go writes a status through the stream it keeps in the handler's
// context (grpc.ServerTransportStreamFromContext); its WriteStatus is the
// call that ends every RPC, the same that Recv makes when it fails. It is not
// part of the ServerTransportStream interface, so a grpc-go upgrade may drop
// it: the broker runs Check at start, and does not start if End cannot end
// an RPC; Supported says whether a given RPC can be ended, and the broker
// refuses to splice one that cannot. This package's tests gate an upgrade.
package abortable

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// statusWriter is the part of grpc-go's server stream that End uses.
type statusWriter interface {
	WriteStatus(*status.Status) error
}

// End ends the RPC whose handler's context, or a context derived from it, is
// ctx, with the status of err (OK for nil). The handler's own status, when it
// returns, is then ignored. End on an RPC that has ended does nothing.
func End(ctx context.Context, err error) {
	if w, ok := grpc.ServerTransportStreamFromContext(ctx).(statusWriter); ok {
		_ = w.WriteStatus(status.Convert(err))
	}
}

// Supported reports whether End can end the RPC of ctx.
func Supported(ctx context.Context) bool {
	_, ok := grpc.ServerTransportStreamFromContext(ctx).(statusWriter)
	return ok
}

package abortable

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// The check the broker runs at start passes with the grpc-go in go.mod.
// With abortable_test.go, it gates a grpc-go upgrade.
func TestCheckPassesWithThisGRPC(t *testing.T) {
	if err := Check(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// hiddenStream is a grpc-go server stream without the method End uses, as
// a grpc-go that dropped it would have.
type hiddenStream struct{ grpc.ServerTransportStream }

// idleStream has the method, but it does nothing, as a grpc-go that changed
// what it does might.
type idleStream struct{ grpc.ServerTransportStream }

func (idleStream) WriteStatus(*status.Status) error { return nil }

// replacing serves each RPC with its transport stream replaced by wrap's.
func replacing(wrap func(grpc.ServerTransportStream) grpc.ServerTransportStream) grpc.ServerOption {
	return grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		ctx := grpc.NewContextWithServerTransportStream(ss.Context(), wrap(grpc.ServerTransportStreamFromContext(ss.Context())))
		return handler(srv, withContext{ss, ctx})
	})
}

type withContext struct {
	grpc.ServerStream
	ctx context.Context
}

func (s withContext) Context() context.Context { return s.ctx }

func TestCheckFailsNamingThePackageAndGRPCVersionWhenEndCannotEndAnRPC(t *testing.T) {
	for name, wrap := range map[string]func(grpc.ServerTransportStream) grpc.ServerTransportStream{
		"WriteStatus is gone":     func(s grpc.ServerTransportStream) grpc.ServerTransportStream { return hiddenStream{s} },
		"WriteStatus ends no RPC": func(s grpc.ServerTransportStream) grpc.ServerTransportStream { return idleStream{s} },
	} {
		t.Run(name, func(t *testing.T) {
			// A short bound: when WriteStatus does nothing, only it ends the RPC.
			err := check(t.Context(), time.Second, replacing(wrap))
			if err == nil {
				t.Fatal("the check passed")
			}
			t.Log(err)
			for _, want := range []string{"broker/internal/abortable", "grpc-go " + grpc.Version, "WriteStatus"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("%q does not name %q", err, want)
				}
			}
		})
	}
}

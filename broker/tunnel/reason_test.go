package tunnel

import (
	"io"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
	"github.com/kcp-dev/tunnel-broker/internal/splice"
)

// The caller's status of a tunnel the broker ended carries its reason
// (docs/protocol.md §5): the agent's side lost, the broker's stop.
func TestTheCallersStatusCarriesItsReason(t *testing.T) {
	for _, tc := range []struct {
		f      *splice.Failure
		code   codes.Code
		reason string
	}{
		{&splice.Failure{By: splice.B, Err: io.ErrUnexpectedEOF}, codes.Unavailable, errinfo.TunnelLost},
		{&splice.Failure{By: splice.Neither, Err: errStopping}, codes.Unavailable, errinfo.BrokerStopping},
		{&splice.Failure{By: splice.A, Err: io.EOF}, codes.Canceled, ""},
	} {
		callerStatus, _ := (&Tunnel{ID: "t-1"}).statuses(tc.f)
		if status.Code(callerStatus) != tc.code || errinfo.Of(callerStatus) != tc.reason {
			t.Errorf("%v: the caller hears %v with reason %q, want %s with %q", tc.f.Err, callerStatus, errinfo.Of(callerStatus), tc.code, tc.reason)
		}
	}
}

package registry

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// Each failure of a dial carries its reason (docs/protocol.md §5), which
// clients read instead of the message.

func wantReason(t *testing.T, what string, err error, code codes.Code, reason string) {
	t.Helper()
	if status.Code(err) != code || errinfo.Of(err) != reason {
		t.Errorf("%s: %v with reason %q, want %s with reason %q", what, err, errinfo.Of(err), code, reason)
	}
}

func TestAFailedDialCarriesItsReason(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")

	_, err := r.Dial(t.Context(), target("elsewhere"), nil)
	wantReason(t, "no agent", err, codes.Unavailable, errinfo.NoAgent)

	d, o := orderedDial(t, r, "root", a)
	failOrder(r, a, o, codes.PermissionDenied, "refused")
	wantReason(t, "the agent's failure", d.wait().err, codes.PermissionDenied, errinfo.AgentDialFailed)

	d, o = orderedDial(t, r, "root", a)
	failOrder(r, a, o, codes.Internal, "oops")
	wantReason(t, "the agent's failure with a code not passed through", d.wait().err, codes.Unavailable, errinfo.AgentDialFailed)

	// The agent's reason is passed on when it is one an agent may send,
	// and taken for AGENT_DIAL_FAILED otherwise.
	for sent, want := range map[string]string{
		errinfo.NoEndpoints: errinfo.NoEndpoints, errinfo.TargetRefused: errinfo.TargetRefused,
		errinfo.TargetUnreachable: errinfo.TargetUnreachable, errinfo.NoAgent: errinfo.AgentDialFailed, "MADE_UP": errinfo.AgentDialFailed,
	} {
		d, o = orderedDial(t, r, "root", a)
		r.Fail(a, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(codes.NotFound), Message: "no", Reason: sent})
		wantReason(t, "the agent's failure with reason "+sent, d.wait().err, codes.NotFound, want)
	}

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancel()
	_, err = r.Dial(ctx, target("root"), nil)
	nextOrder(t, a)
	wantReason(t, "no answer in time", err, codes.DeadlineExceeded, errinfo.AgentTimeout)

	d, _ = orderedDial(t, r, "root", a)
	r.Unregister(a)
	wantReason(t, "the agent gone", d.wait().err, codes.Unavailable, errinfo.AgentGone)
}

func TestADialFailedTwiceCarriesTheSecondsReason(t *testing.T) {
	r, d, first, second, _ := failedOnce(t)
	nextOrder(t, second)
	r.Unregister(second)
	err := d.wait().err
	wantReason(t, "the dial", err, codes.Unavailable, errinfo.AgentGone)
	if !strings.Contains(status.Convert(err).Message(), "; before it, agent "+first.Name+": refused once") {
		t.Errorf("the dial: %v, want it to name the first failure", err)
	}
}

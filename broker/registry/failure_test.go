package registry

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// What a caller sees of a failed dial, and what the broker keeps for its log.

// What an agent reports reaches the caller short, and without the agent's
// SPIFFE ID or any address; the broker keeps it whole for its log.
func TestAFailureShowsTheCallerNoAddressesNorTheAgentsSPIFFEID(t *testing.T) {
	r := New(Limits{})
	a := newTestAgent(t, "sync-target-1", "/agent/a", "root")
	r.Register(a)
	d, o := orderedDial(t, r, "root", a)

	said := "dial tcp 10.1.2.3:8443: connect: connection refused"
	r.Fail(a, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(codes.Unavailable), Message: said})
	err := d.wait().err
	testutil.CheckStatus(t, "dial", err, codes.Unavailable, "agent sync-target-1: dial tcp <address>: connect: connection refused"+inTunnel(o.GetDialId()))
	failed, ok := errors.AsType[*DialError](err)
	if !ok {
		t.Fatalf("%v is not a DialError", err)
	}
	logged := fmt.Sprint(failed.LogAttrs()...)
	for _, want := range []string{said, a.ID.String(), fmt.Sprintf("%016x", o.GetDialId())} {
		if !strings.Contains(logged, want) {
			t.Errorf("the broker's log attributes %q do not hold %q", logged, want)
		}
	}
}

func TestALongFailureIsCutForTheCallerAndTheLog(t *testing.T) {
	r := New(Limits{})
	a := registerAgent(t, r, "a", "root")
	d, o := orderedDial(t, r, "root", a)

	said := strings.Repeat("refused ", 900<<10/8)
	r.Fail(a, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(codes.Unavailable), Message: said})
	err := d.wait().err
	overhead := len("agent a: " + inTunnel(o.GetDialId()))
	if n := len(status.Convert(err).Message()); n > MaxAgentMessage+overhead {
		t.Errorf("the caller's message has %d bytes, want at most %d", n, MaxAgentMessage+overhead)
	}
	failed, _ := errors.AsType[*DialError](err)
	if failed == nil || len(failed.AgentMessage) != MaxLoggedAgentMessage || failed.AgentMessageBytes != len(said) {
		t.Errorf("logged %v, want %d bytes of the agent's message and its length %d", failed, MaxLoggedAgentMessage, len(said))
	}
}

// The name an agent registers with is its own choice: the caller sees it
// redacted, and an agent without one as "the agent".
func TestAnAgentsNameIsRedactedForTheCaller(t *testing.T) {
	for _, tc := range []struct{ name, want string }{
		{"", "the agent: refused"},
		{"10.0.0.9:8443", "agent <address>: refused"},
		{"spiffe://example.org/agent/a", "agent <url>: refused"},
		{strings.Repeat("n", 1000), "agent " + strings.Repeat("n", 61) + "…: refused"},
	} {
		r := New(Limits{})
		a := newTestAgent(t, tc.name, "/agent/a", "root")
		r.Register(a)
		d, o := orderedDial(t, r, "root", a)
		r.Fail(a, &tunnelv1.DialFailure{DialId: o.GetDialId(), Code: int32(codes.Unavailable), Message: "refused"})
		testutil.CheckStatus(t, fmt.Sprintf("agent named %.20q", tc.name), d.wait().err, codes.Unavailable, tc.want+inTunnel(o.GetDialId()))
	}
}

package errinfo

import (
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A reason survives what a status goes through: wrapping, a new message,
// and the trip to the client as status proto (status.FromProto is what
// grpc-go does with the grpc-status-details-bin trailer).
func TestReasonSurvives(t *testing.T) {
	err := Errorf(codes.Unavailable, NoAgent, "no agent serves logical cluster %q", "root")
	if got := Of(err); got != NoAgent {
		t.Fatalf("Of = %q, want %q", got, NoAgent)
	}
	if got := Of(fmt.Errorf("dial: %w", err)); got != NoAgent {
		t.Errorf("Of(wrapped) = %q, want %q", got, NoAgent)
	}
	renamed := WithMessage(status.Convert(err), "other words")
	if Of(renamed.Err()) != NoAgent || renamed.Code() != codes.Unavailable || renamed.Message() != "other words" {
		t.Errorf("WithMessage: %v, reason %q; want Unavailable, other words, %q", renamed.Err(), Of(renamed.Err()), NoAgent)
	}
	if got := Of(status.FromProto(status.Convert(err).Proto()).Err()); got != NoAgent {
		t.Errorf("Of(after the wire) = %q", got)
	}
	for _, e := range []error{nil, errors.New("no agent serves logical cluster"), status.Error(codes.Unavailable, "no agent serves logical cluster")} {
		if got := Of(e); got != "" {
			t.Errorf("Of(%v) = %q, want none: a reason is never read from text", e, got)
		}
	}
}

package testutil

import (
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// recorder is a testing.TB that records failures instead of failing.
type recorder struct {
	testing.TB
	failed bool
}

func (r *recorder) Helper()               {}
func (r *recorder) Errorf(string, ...any) { r.failed = true }
func (r *recorder) Fatalf(string, ...any) { r.failed = true }

func TestCheckStatusMatchesCodeAndMessage(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		fail bool
	}{
		{"same code, message contains", status.Error(codes.NotFound, "agent a: no route"), false},
		{"other code", status.Error(codes.Unavailable, "agent a: no route"), true},
		{"message lacks it", status.Error(codes.NotFound, "agent a"), true},
		{"nil", nil, true},
		{"not a status", errors.New("no route"), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &recorder{TB: t}
			CheckStatus(r, "dial", tc.err, codes.NotFound, "no route")
			if r.failed != tc.fail {
				t.Errorf("CheckStatus failed the test: %v, want %v", r.failed, tc.fail)
			}
		})
	}
}

func TestWaitAndEventuallyReturnOnceReady(t *testing.T) {
	c := make(chan int, 1)
	c <- 7
	if got := Wait(t, "a value", c); got != 7 {
		t.Errorf("Wait = %d, want 7", got)
	}
	n := 0
	Eventually(t, "the third poll", func() bool { n++; return n == 3 })
}

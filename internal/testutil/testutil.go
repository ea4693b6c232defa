// Package testutil is the one home of the waits and checks every test of
// the repository shares, like go-spiffe's internal/test: tests wait with
// Wait and Eventually, bounded by WaitLong, and check gRPC statuses with
// CheckStatus, and read what a logger wrote with LogBuffer. kcpplugin, a
// module of its own that must not require this one, keeps its own copies.
package testutil

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// WaitLong bounds every wait for something that should happen. A healthy run
// needs a tiny fraction of it; reaching it means a hang. It is a minute
// because a burst of 2000 streams under the race detector took over 20 s on
// a machine loaded twenty times over its two cores.
const WaitLong = time.Minute

// Wait is what c gives, and fails the test if it gives nothing within
// WaitLong.
func Wait[T any](t testing.TB, what string, c <-chan T) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(WaitLong):
		t.Fatalf("timed out after %v waiting for %s", WaitLong, what)
		var zero T
		return zero
	}
}

// Eventually polls cond until it holds, and fails the test if it does not
// within WaitLong.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(WaitLong)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", WaitLong, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// CheckStatus checks err's code and that its message contains message.
func CheckStatus(t testing.TB, what string, err error, code codes.Code, message string) {
	t.Helper()
	st := status.Convert(err)
	if err == nil || st.Code() != code || !strings.Contains(st.Message(), message) {
		t.Errorf("%s: got %v, want %v with a message containing %q", what, err, code, message)
	}
}

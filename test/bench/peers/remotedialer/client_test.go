package main

import "testing"

// Run with: GOWORK=off GOTOOLCHAIN=go1.27.3 go test . (this module is
// outside go.work and make test; tunnelbench's smoke test runs the peer).

func TestTheServerMayDialLoopbackTCPOnly(t *testing.T) {
	for _, c := range []struct {
		proto, address string
		allowed        bool
	}{
		{"tcp", "127.0.0.1:8080", true},
		{"tcp", "[::1]:443", true},
		{"tcp", "10.0.0.1:443", false},
		{"tcp", "localhost:443", false}, // names are not resolved here
		{"udp", "127.0.0.1:53", false},
		{"tcp", "127.0.0.1", false},
	} {
		if got := loopbackOnly(c.proto, c.address); got != c.allowed {
			t.Errorf("loopbackOnly(%q, %q) = %v, want %v", c.proto, c.address, got, c.allowed)
		}
	}
}

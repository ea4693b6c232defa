package main

import (
	"errors"
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
)

// The broker's flags mean what they say: a value that would silently mean
// something else is refused, naming the flag, as a mistake in the flags.
func TestParseFlagsRefusesWhatTheFlagsDoNotMean(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string // "" for none
	}{
		{nil, ""},
		{[]string{"--window-size", "65535"}, ""},
		{[]string{"--window-size", "-1"}, ""},
		{[]string{"--window-size", "134217727"}, ""},
		{[]string{"--window-size", "0"}, "--window-size 0: below 65535"},
		{[]string{"--window-size", "65534"}, "--window-size 65534: below 65535, HTTP/2's initial window, gRPC would ignore it"},
		{[]string{"--window-size", "134217728"}, "--window-size 134217728: over 134217727"},
		{[]string{"--idle-timeout", "-1s"}, ""},
		{[]string{"--idle-timeout", "0"}, "--idle-timeout 0s: must be positive (negative: never)"},
		{[]string{"--grace", "0s"}, "--grace 0s: must be positive"},
		{[]string{"--dial-timeout", "0s"}, "--dial-timeout 0s: must be positive"},
		{[]string{"--startup-grace", "0s"}, "--startup-grace 0s: must be positive (negative: ready at once)"},
		{[]string{"--egress-uds", "/run/egress.sock"}, "--egress-uds /run/egress.sock needs --egress-uds-cluster"},
		{[]string{"--egress-uds-cluster", "root"}, "--egress-uds-cluster root needs --egress-uds"},
		{[]string{"--egress-uds", "/run/egress.sock", "--egress-uds-cluster", "root:org"}, "--egress-uds-cluster: "},
		{[]string{"--egress-uds", "/run/egress.sock", "--egress-uds-cluster", "root"}, ""},
		{[]string{"--no-such-flag"}, "flag provided but not defined: -no-such-flag"},
	} {
		args := append([]string{"--policy", "policy.yaml"}, tc.args...)
		_, err := parseFlags(flag.NewFlagSet("broker", flag.ExitOnError), args, io.Discard)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
		var fe *flagcheck.FlagError
		if err != nil && !errors.As(err, &fe) {
			t.Errorf("%v: %v is not a mistake in the flags", tc.args, err)
		}
	}
	if _, err := parseFlags(flag.NewFlagSet("broker", flag.ExitOnError), nil, io.Discard); err == nil || !strings.Contains(err.Error(), "--policy is required") {
		t.Errorf("no --policy: %v", err)
	}
	if o, err := parseFlags(flag.NewFlagSet("broker", flag.ExitOnError), []string{"--version"}, io.Discard); err != nil || !o.showVersion {
		t.Errorf("--version without --policy: %v", err)
	}
}

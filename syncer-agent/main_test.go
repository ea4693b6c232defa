package main

import (
	"errors"
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
)

// The agent's flags mean what they say: a required flag is required, an
// address has its port, and a value that would silently mean something else
// is refused, naming the flag, as a mistake in the flags.
func TestParseFlagsRefusesWhatTheFlagsDoNotMean(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string // "" for none
	}{
		{[]string{"--broker", "127.0.0.1:8443", "--name", "a", "--services", "s.yaml"}, ""},
		{[]string{"--broker", "b-0:8443,b-1:8443", "--broker", "b-2:8443", "--name", "a", "--services", "s.yaml"}, ""},
		{[]string{"--broker-dns", "broker.svc:8443", "--name", "a", "--plain-cluster", "root"}, ""},
		{[]string{"--broker-lb", "tunnel.example.com:443", "--name", "a", "--plain-cluster", "root"}, ""},
		{[]string{"--name", "a", "--services", "s.yaml"}, "--broker, --broker-dns or --broker-lb is required"},
		{[]string{"--broker-lb", "lb:443", "--broker", "b-0:8443", "--name", "a", "--services", "s.yaml"}, "--broker-lb reaches every replica through one address: it takes neither --broker nor --broker-dns"},
		{[]string{"--broker-lb", "lb:443", "--broker-dns", "b.svc:8443", "--name", "a", "--services", "s.yaml"}, "it takes neither"},
		{[]string{"--broker-lb", "lb", "--name", "a", "--services", "s.yaml"}, "--broker-lb lb: no port"},
		{[]string{"--broker", "127.0.0.1:8443", "--services", "s.yaml"}, "--name is required"},
		{[]string{"--broker", "127.0.0.1:8443", "--name", "A_b", "--services", "s.yaml"}, `--name: agent name "A_b" is not a DNS-1123 label`},
		{[]string{"--broker", "localhost", "--name", "a", "--services", "s.yaml"}, "--broker localhost: no port: give HOST:PORT, e.g. localhost:8443"},
		{[]string{"--broker", "b-0:8443,b-1", "--name", "a", "--services", "s.yaml"}, "--broker b-1: no port"},
		{[]string{"--broker-dns", "broker.svc", "--name", "a", "--services", "s.yaml"}, "--broker-dns broker.svc: no port"},
		{[]string{"--broker", "127.0.0.1:8443", "--name", "a"}, "give --services FILE"},
		{[]string{"--broker", "127.0.0.1:8443", "--name", "a", "--services", "s.yaml", "--plain-cluster", "root"}, "--services excludes"},
		{[]string{"--broker", "127.0.0.1:8443", "--name", "a", "--services", "s.yaml", "--reconnect-max-delay", "0"}, "--reconnect-max-delay 0s: must be positive"},
		{[]string{"--broker", "127.0.0.1:8443", "--name", "a", "--services", "s.yaml", "--grace", "0"}, "--grace 0s: must be positive"},
		{[]string{"--broker", "127.0.0.1:8443", "--name", "a", "--services", "s.yaml", "--resolve-interval", "0"}, "--resolve-interval 0s: must be positive"},
		{[]string{"--nmae", "a"}, "flag provided but not defined: -nmae"},
		{[]string{"--version"}, ""},
	} {
		_, err := parseFlags(flag.NewFlagSet("syncer-agent", flag.ExitOnError), tc.args, io.Discard)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
		var fe *flagcheck.FlagError
		if err != nil && !errors.As(err, &fe) {
			t.Errorf("%v: %v is not a mistake in the flags", tc.args, err)
		}
	}
}

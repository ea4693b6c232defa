package flagcheck

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"strings"
	"testing"
	"time"
)

func TestCheckNamesTheFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string // "" for no error
	}{
		{nil, ""},
		{[]string{"--timeout", "-1s"}, "--timeout -1s: must not be negative"},
		{[]string{"--idle", "-1s"}, ""}, // its usage says what negative means
		{[]string{"--limit", "-3"}, "--limit -3: must not be negative"},
		{[]string{"--limit", "0"}, ""},
		{[]string{"--size", "0"}, "--size 0: must be positive"},
		{[]string{"--idle", "0s"}, "--idle 0s: must be positive (negative: never)"},
		{[]string{"extra"}, `unexpected argument "extra"`},
	} {
		fs := flag.NewFlagSet("x", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		fs.Duration("timeout", time.Second, "how long")
		fs.Duration("idle", time.Second, "idle limit (negative: never)")
		fs.Int64("limit", 5, "a limit (0: no limit)")
		fs.Int("size", 5, "a size")
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		err := Check(fs, "size", "idle")
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%v: got %v, want %q", tc.args, err, tc.want)
		}
		var fe *FlagError
		if err != nil && !errors.As(err, &fe) {
			t.Errorf("%v: %v is not a FlagError, so it would not point at --help", tc.args, err)
		}
	}
}

// A mistake prints nothing while parsing: the binary reports it as one
// error and one line pointing at --help, exit code 2; --help prints the
// whole usage to stdout, exit code 0.
func TestParseAndReport(t *testing.T) {
	for _, tc := range []struct {
		args           []string
		code           int
		stdout, stderr string
	}{
		{[]string{"--listen", "x"}, 0, "", ""},
		{[]string{"--nope"}, 2, "", "x: flag provided but not defined: -nope\nRun 'x --help' for usage.\n"},
		{[]string{"--timeout", "soon"}, 2, "", "x: invalid value \"soon\" for flag -timeout: parse error\nRun 'x --help' for usage.\n"},
		{[]string{"--help"}, 0, "x: what x is for\n\nUsage:\n  x [flags]\n\nFlags:\n  -listen string", ""},
		{[]string{"-h"}, 0, "x: what x is for", ""},
	} {
		fs := flag.NewFlagSet("x", flag.ExitOnError) // Parse must not exit
		var stdout, stderr, output bytes.Buffer
		fs.SetOutput(&output)
		fs.String("listen", "", "address")
		fs.Duration("timeout", time.Second, "how long")
		Usage(fs, "x: what x is for", "x [flags]")
		code := Report(&stderr, "x", Parse(fs, tc.args, &stdout))
		if code != tc.code || !strings.HasPrefix(stdout.String(), tc.stdout) || stderr.String() != tc.stderr {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want %d, %q..., %q", tc.args, code, stdout.String(), stderr.String(), tc.code, tc.stdout, tc.stderr)
		}
		if tc.stdout == "" && stdout.Len() > 0 {
			t.Errorf("%v printed the usage: %q", tc.args, stdout.String())
		}
		if output.Len() > 0 {
			t.Errorf("%v printed to the flag set's output: %q", tc.args, output.String())
		}
	}
	var stderr bytes.Buffer
	if code := Report(&stderr, "x", errors.New("no SVID")); code != 1 || stderr.String() != "x: no SVID\n" {
		t.Errorf("another error: exit %d, %q", code, stderr.String())
	}
	stderr.Reset()
	err := &FlagError{Err: errors.New("want one argument"), Help: "x sub --help"}
	if code := Report(&stderr, "x", err); code != 2 || !strings.HasSuffix(stderr.String(), "Run 'x sub --help' for usage.\n") {
		t.Errorf("a subcommand's mistake: exit %d, %q", code, stderr.String())
	}
}

func TestHostPort(t *testing.T) {
	for addr, want := range map[string]string{
		"localhost:8443":  "",
		"127.0.0.1:1":     "",
		"[::1]:8443":      "",
		"localhost":       "--broker localhost: no port: give HOST:PORT, e.g. localhost:8443",
		"broker.svc:":     "--broker broker.svc:: no port",
		":8443":           "--broker :8443: no host",
		"::1":             "--broker ::1: address ::1: too many colons in address: give HOST:PORT",
		"tunnel-broker-0": "e.g. tunnel-broker-0:8443",
	} {
		err := HostPort("broker", addr)
		if want == "" && err != nil || want != "" && (err == nil || !strings.Contains(err.Error(), want)) {
			t.Errorf("%q: %v, want %q", addr, err, want)
		}
	}
}

package flagcheck

import (
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
		err := Check(fs, "size")
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%v: got %v, want %q", tc.args, err, tc.want)
		}
	}
}

// Package flagcheck refuses, at start and with the flag named, values the
// binaries' flags do not allow, and gives them a --help that starts with
// what the binary is for.
package flagcheck

import (
	"flag"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Check refuses what fs holds after Parse that its flags do not allow:
//   - a negative duration or number, unless the flag's usage says what a
//     negative value means ("negative: never");
//   - zero for the flags named in positive;
//   - arguments, for binaries that take flags only.
func Check(fs *flag.FlagSet, positive ...string) error {
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q: only flags are taken (--help lists them)", fs.Arg(0))
	}
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if err == nil {
			err = checkValue(f, positive)
		}
	})
	return err
}

func checkValue(f *flag.Flag, positive []string) error {
	getter, ok := f.Value.(flag.Getter)
	if !ok {
		return nil
	}
	var negative, zero bool
	switch v := getter.Get().(type) {
	case time.Duration:
		negative, zero = v < 0, v == 0
	case int:
		negative, zero = v < 0, v == 0
	case int64:
		negative, zero = v < 0, v == 0
	case uint:
		zero = v == 0
	case uint64:
		zero = v == 0
	default:
		return nil
	}
	switch {
	case negative && !strings.Contains(f.Usage, "negative:"):
		return fmt.Errorf("--%s %s: must not be negative", f.Name, f.Value)
	case zero && slices.Contains(positive, f.Name):
		return fmt.Errorf("--%s %s: must be positive", f.Name, f.Value)
	}
	return nil
}

// Usage makes fs's --help start with synopsis (one line: what the binary
// is for), then how to call it, then the flags; flags whose usage starts
// with "required" say so there.
func Usage(fs *flag.FlagSet, synopsis, usage string) {
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "%s\n\nUsage:\n  %s\n\nFlags:\n", synopsis, usage)
		fs.PrintDefaults()
	}
}

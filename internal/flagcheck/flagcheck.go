// Package flagcheck refuses, at start and with the flag named, values the
// binaries' flags do not allow, and gives them a --help that starts with
// what the binary is for. A mistake in the flags is reported as the error
// and one line pointing at --help, never the whole usage burying it.
package flagcheck

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"time"
)

// FlagError is a mistake in how a binary was called: a flag, its value or
// an argument. Report prints it with a pointer to --help.
type FlagError struct {
	Err error
	// Help is the command that prints the usage ("tunnelctl agents
	// --help"); empty: the binary's --help.
	Help string
}

func (e *FlagError) Error() string { return e.Err.Error() }
func (e *FlagError) Unwrap() error { return e.Err }

// Errorf is a FlagError with a formatted message.
func Errorf(format string, a ...any) error {
	return &FlagError{Err: fmt.Errorf(format, a...)}
}

// Parse parses args into fs without printing anything on a mistake: it
// returns the mistake as a FlagError. --help (-h) prints fs's usage to
// stdout and returns flag.ErrHelp, which Report takes for success. fs's
// error handling becomes ContinueOnError, whatever it was.
func Parse(fs *flag.FlagSet, args []string, stdout io.Writer) error {
	out, usage := fs.Output(), fs.Usage
	fs.Init(fs.Name(), flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	err := fs.Parse(args)
	fs.Usage = usage
	switch {
	case errors.Is(err, flag.ErrHelp):
		fs.SetOutput(stdout)
		fs.Usage()
		fs.SetOutput(out)
		return flag.ErrHelp
	case err != nil:
		fs.SetOutput(out)
		return &FlagError{Err: err}
	}
	fs.SetOutput(out)
	return nil
}

// Report prints err as the binary name's main does and returns its exit
// code: 0 for none or flag.ErrHelp; 2 for a FlagError, printed with one
// line pointing at --help; 1 for any other error.
func Report(stderr io.Writer, name string, err error) int {
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return 0
	}
	fmt.Fprintf(stderr, "%s: %v\n", name, err)
	var fe *FlagError
	if !errors.As(err, &fe) {
		return 1
	}
	help := fe.Help
	if help == "" {
		help = name + " --help"
	}
	fmt.Fprintf(stderr, "Run '%s' for usage.\n", help)
	return 2
}

// Check refuses what fs holds after Parse that its flags do not allow:
//   - a negative duration or number, unless the flag's usage says what a
//     negative value means ("negative: never");
//   - zero for the flags named in positive;
//   - arguments, for binaries that take flags only.
//
// Its errors are FlagErrors.
func Check(fs *flag.FlagSet, positive ...string) error {
	if fs.NArg() > 0 {
		return Errorf("unexpected argument %q: only flags are taken", fs.Arg(0))
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
		return Errorf("--%s %s: must not be negative", f.Name, f.Value)
	case zero && slices.Contains(positive, f.Name):
		if off := negativeMeans(f.Usage); off != "" {
			return Errorf("--%s %s: must be positive (negative: %s)", f.Name, f.Value, off)
		}
		return Errorf("--%s %s: must be positive", f.Name, f.Value)
	}
	return nil
}

// negativeMeans is what a flag's usage says a negative value means, from
// its "(negative: ...)"; empty if it says nothing.
func negativeMeans(usage string) string {
	_, after, ok := strings.Cut(usage, "negative: ")
	if !ok {
		return ""
	}
	if i := strings.IndexAny(after, ")"); i >= 0 {
		after = after[:i]
	}
	return after
}

// HostPort refuses an address that is not HOST:PORT with both parts, as
// flag name's value: without it, a gRPC client would silently take port
// 443.
func HostPort(name, addr string) error {
	host, port, err := net.SplitHostPort(addr)
	switch {
	case err != nil:
		var ae *net.AddrError
		if errors.As(err, &ae) && ae.Err == "missing port in address" {
			return Errorf("--%s %s: no port: give HOST:PORT, e.g. %s", name, addr, net.JoinHostPort(addr, "8443"))
		}
		return Errorf("--%s %s: %v: give HOST:PORT", name, addr, err)
	case host == "":
		return Errorf("--%s %s: no host: give HOST:PORT, e.g. localhost%s", name, addr, addr)
	case port == "":
		return Errorf("--%s %s: no port: give HOST:PORT, e.g. %s8443", name, addr, addr)
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

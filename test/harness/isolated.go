package harness

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// IsolatedNet is the address range the isolated tests own: it is put on the
// loopback interface of their network namespace, so any address in it can be
// listened on there and nowhere else. 192.0.2.0/24 is TEST-NET-1 (RFC 5737).
const IsolatedNet = "192.0.2.0/24"

// IsolatedAPIServerIP is the address in IsolatedNet that a kube-apiserver
// advertises; webhook endpoints use others.
const IsolatedAPIServerIP = "192.0.2.10"

// isolationEnv tells a re-executed test binary what it is there for.
const isolationEnv = "TUNNEL_TEST_ISOLATION"

// RunIsolated is a TestMain for tests that need addresses other than
// loopback, or start servers that might send traffic elsewhere (a
// kube-apiserver calls Service IPs): it re-runs the test binary inside a new
// network namespace that has only a loopback interface, holding IsolatedNet
// and a default route into it, so no packet can leave the machine. There it
// calls run, which runs the tests (m.Run) and returns the exit code.
//
// Before that, and only if the command line selects any test of the
// package, prepare runs outside the namespace: e.g. to build binaries,
// which may need the Go module proxy.
func RunIsolated(m *testing.M, prepare func() error, run func() int) int {
	switch os.Getenv(isolationEnv) {
	case "list": // answering the parent's question which tests are selected
		return m.Run()
	case "netns":
		if err := setUpIsolatedNet(); err != nil {
			fmt.Fprintln(os.Stderr, "isolated network:", err)
			return 1
		}
		return run()
	}

	flag.Parse()
	if f := flag.Lookup("test.list"); f != nil && f.Value.String() != "" {
		return m.Run()
	}
	selected, err := selectedTests()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if !selected {
		return m.Run() // runs nothing, and says so as usual
	}
	if prepare != nil {
		if err := prepare(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	return rerun("netns", os.Args[1:], nil)
}

// selectedTests asks the test binary itself, with -test.list and the
// -test.run pattern, whether the command line selects any of its tests.
func selectedTests() (bool, error) {
	pattern := ".*"
	if f := flag.Lookup("test.run"); f != nil && f.Value.String() != "" {
		// -run matches subtests after a slash; -list knows top-level tests.
		pattern = strings.SplitN(f.Value.String(), "/", 2)[0]
	}
	var out bytes.Buffer
	if code := rerun("list", []string{"-test.list", pattern}, &out); code != 0 {
		return false, fmt.Errorf("listing the tests failed (exit %d): %s", code, out.String())
	}
	for _, line := range strings.Split(out.String(), "\n") {
		if strings.HasPrefix(line, "Test") {
			return true, nil
		}
	}
	return false, nil
}

// rerun runs this test binary again with args, in a new network namespace
// for "netns", and returns its exit code. Its output is ours unless out is
// given. If this process dies, the child is killed with it.
func rerun(mode string, args []string, out *bytes.Buffer) int {
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var cmd *exec.Cmd
	if mode == "netns" {
		unshare := []string{"--net"}
		if os.Geteuid() != 0 {
			// Unprivileged: a user namespace makes us root over the new
			// network namespace, which is all that is needed.
			unshare = []string{"--user", "--map-root-user", "--net"}
		}
		cmd = exec.Command("unshare", append(append(unshare, "--", self), args...)...)
	} else {
		cmd = exec.Command(self, args...)
	}
	cmd.Env = append(os.Environ(), isolationEnv+"="+mode)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, os.Stdout, os.Stderr
	if out != nil {
		cmd.Stdout, cmd.Stderr = out, out
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	err = cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0
	case errors.As(err, &exit) && exit.ExitCode() > 0:
		return exit.ExitCode()
	default:
		fmt.Fprintf(os.Stderr, "running the tests in a network namespace of their own: %v\n", err)
		return 1
	}
}

// setUpIsolatedNet brings up loopback with IsolatedNet, routes everything
// else there too, and checks that the namespace has no other interface.
func setUpIsolatedNet() error {
	if _, err := exec.LookPath("ip"); err != nil {
		return fmt.Errorf("the isolated tests need iproute2's ip (apt-get install iproute2): %w", err)
	}
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"addr", "add", IsolatedAPIServerIP + "/24", "dev", "lo"},
		// A kube-apiserver wants a default route to pick an address to
		// advertise; through lo, nothing it sends leaves the namespace.
		{"route", "add", "default", "dev", "lo"},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	return CheckIsolated()
}

// CheckIsolated returns an error unless this process is in a network
// namespace whose only interface is loopback: the guard for anything that
// must never reach the machine's real network.
func CheckIsolated() error {
	ifs, err := net.Interfaces()
	if err != nil {
		return err
	}
	for _, i := range ifs {
		if i.Flags&net.FlagLoopback == 0 {
			return fmt.Errorf("interface %s is not loopback: refusing to run outside an isolated network namespace", i.Name)
		}
	}
	if os.Getenv(isolationEnv) != "netns" {
		return errors.New("not in the network namespace RunIsolated makes")
	}
	return nil
}

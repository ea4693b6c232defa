package harness

import (
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"time"

	"sigs.k8s.io/yaml"
)

// SharedBinaries puts the broker and syncer-agent (from Binaries) and the
// given main packages of this repository, built, into dir, where every user
// may run them, and returns dir.
func SharedBinaries(t T, dir string, mainPackages ...string) string {
	t.Helper()
	from := Binaries(t)
	for _, name := range []string{"broker", "syncer-agent"} {
		copyFile(t, filepath.Join(from, name), filepath.Join(dir, name), 0o755)
	}
	if len(mainPackages) > 0 {
		cmd := exec.Command("go", append([]string{"build", "-o", dir + "/"}, mainPackages...)...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("building %v: %v\n%s", mainPackages, err, out)
		}
	}
	return dir
}

func copyFile(t T, from, to string, mode os.FileMode) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		t.Fatal(err)
	}
	must(t, out.Close())
}

// WriteShared writes v as YAML (or raw bytes as they are) to dir/name,
// readable by every user, and returns the path.
func WriteShared(t T, dir, name string, v any) string {
	t.Helper()
	raw, ok := v.([]byte)
	if !ok {
		var err error
		if raw, err = yaml.Marshal(v); err != nil {
			t.Fatal(err)
		}
	}
	path := filepath.Join(dir, name)
	must(t, os.WriteFile(path, raw, 0o644))
	must(t, os.Chmod(path, 0o644)) // whatever the umask
	return path
}

// Workload says how to run a binary as a SPIFFE workload: with which
// command prefix (e.g. AsUser("tunnel-broker")), taking its identity from
// which Workload API.
type Workload struct {
	Name   string   // for logs
	Bin    string   // folder of the binaries, from SharedBinaries
	Prefix []string // e.g. AsUser(...)
	Socket string   // Workload API address, unix://...
}

func (w Workload) argv(binary string, args ...string) []string {
	argv := append(append([]string{}, w.Prefix...), filepath.Join(w.Bin, binary), "--spiffe-socket", w.Socket)
	return append(argv, args...)
}

// StartBroker runs the broker binary on a loopback port with the policy
// file and waits until it serves (which is after its first SVID arrived),
// up to timeout. It returns the broker and its address.
func (w Workload) StartBroker(t T, policyFile string, timeout time.Duration, extra ...string) (*Command, string) {
	t.Helper()
	c := StartCommand(t, w.Name, w.argv("broker", append([]string{"--listen", "127.0.0.1:0", "--policy", policyFile,
		"--metrics-listen", "127.0.0.1:0"}, extra...)...))
	m := c.WaitFor(t, brokerServingRE, timeout)
	return c, m[1]
}

// StartAgent runs the syncer-agent binary with a static service table. It
// does not wait: see AgentRegistered.
func (w Workload) StartAgent(t T, brokerAddr, servicesFile string, extra ...string) *Command {
	t.Helper()
	return StartCommand(t, w.Name, w.argv("syncer-agent", append([]string{
		"--broker", brokerAddr, "--name", w.Name, "--services", servicesFile, "--metrics-listen", "127.0.0.1:0"}, extra...)...))
}

var brokerServingRE = regexp.MustCompile(`broker serving"? address=(\S+)`)

// AgentRegistered matches the agent's log line for an accepted registration.
var AgentRegistered = regexp.MustCompile(`registered with broker`)

package readme

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// section is the README section these tests run.
const section = "## Run it by hand"

// script is the blocks as one bash script. Lines that run make are left
// out: the test brings the binaries (bin/ links to them).
func script(blocks []string) string {
	var b strings.Builder
	// Whatever happens, the background jobs end with the script.
	b.WriteString("set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n")
	for _, block := range blocks {
		for _, line := range strings.SplitAfter(block, "\n") {
			if strings.HasPrefix(line, "make ") {
				continue
			}
			b.WriteString(line)
		}
	}
	return b.String()
}

// TestReadmeByHand runs the section's commands as a person pasting them
// would, in a fresh folder whose bin/ holds the built binaries and grpcurl,
// and checks what they print: each step's answer came through the tunnel.
func TestReadmeByHand(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(harness.RepoRoot(), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	blocks := harness.ShellBlocks(t, string(raw), section)
	if len(blocks) < 4 {
		t.Fatalf("%q has %d shell blocks; want the setup, the parts, tunnelctl and grpcurl", section, len(blocks))
	}
	dir := t.TempDir()
	linkTools(t, filepath.Join(dir, "bin"))

	// Before the last block ends everything: the target must not serve
	// the folder the commands run in, whose dev/ holds the private keys.
	last := blocks[len(blocks)-1]
	if !strings.Contains(last, "kill $(jobs -p)") {
		t.Fatalf("the section's last block does not end the background jobs:\n%s", last)
	}
	probe := "echo \"dev/ from the target: $(curl -s -o /dev/null -w '%{http_code}' localhost:8080/dev/ca.crt)\"\n"
	blocks = append(blocks[:len(blocks)-1:len(blocks)-1], probe, last)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-c", script(blocks))
	cmd.Dir = dir
	// The script's jobs are in its process group: a timeout ends them all.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the README's commands failed: %v\n%s", err, out)
	}
	for _, want := range []string{
		"throwaway trust domain spiffe://example.org", // dev-ca
		"broker serving",            // the broker's log
		"registered with broker",    // the agent's log
		": 1 agent\n",               // tunnelctl agents
		"HTTP/1.0 200 OK",           // tunnelctl dial and port-forward, through the tunnel
		"hello from the target",     // curl's CONNECT through the egress front end
		"dev/ from the target: 404", // the target serves its own folder only
		"kcp.tunnel.v1.DialService", // grpcurl list
		`"status": "SERVING"`,       // grpcurl health
		`"name": "dev"`,             // grpcurl ListAgents
		`"established"`,             // grpcurl Dial
	} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the README's commands did not print %q:\n%s", want, out)
		}
	}
	if n := strings.Count(string(out), "HTTP/1.0 200 OK"); n < 2 {
		t.Errorf("%d answers from the target, want one through tunnelctl dial and one through port-forward:\n%s", n, out)
	}
}

// The section's waits end: each readiness wait is up, which gives up
// after 10 seconds saying what did not answer, and no loop waits forever.
func TestReadmeByHandWaitsAreBounded(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(filepath.Join(harness.RepoRoot(), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	var up string
	for _, block := range harness.ShellBlocks(t, string(raw), section) {
		for _, line := range strings.Split(block, "\n") {
			if regexp.MustCompile(`^\s*(until|while)\b|;\s*(until|while)\b`).MatchString(line) {
				t.Errorf("a loop with no bound: %s", line)
			}
			if strings.HasPrefix(line, "up() ") {
				up = line
			}
		}
	}
	if up == "" {
		t.Fatal("the section defines no up()")
	}
	// Nothing answers on port 1: up must fail, within its bound, saying so.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	start := time.Now()
	out, err := exec.CommandContext(ctx, "bash", "-c", "set -e\n"+up+"\nup 127.0.0.1:1/readyz\necho past the wait\n").CombinedOutput()
	if err == nil || strings.Contains(string(out), "past the wait") || ctx.Err() != nil {
		t.Errorf("up for an address that never answers: %v after %v: %s", err, time.Since(start), out)
	}
	if !strings.Contains(string(out), "no answer from 127.0.0.1:1/readyz within 10s") {
		t.Errorf("up did not say what did not answer: %q", out)
	}
}

// dev-ca's private keys, written into dev/ by the section, are never
// committed.
func TestReadmeByHandKeysAreIgnoredByGit(t *testing.T) {
	root := harness.RepoRoot()
	if err := exec.Command("git", "-C", root, "rev-parse", "--git-dir").Run(); err != nil {
		t.Skipf("%s is not a git checkout: %v", root, err)
	}
	for _, path := range []string{"dev/ca.crt", "dev/broker/tls.key", "dev/operator/tls.key"} {
		if out, err := exec.Command("git", "-C", root, "check-ignore", "--no-index", "-q", path).CombinedOutput(); err != nil {
			t.Errorf("git does not ignore %s: %v %s", path, err, out)
		}
	}
}

// linkTools makes bin with the built broker, syncer-agent, tunnelctl and
// grpcurl, where make build tools puts them.
func linkTools(t *testing.T, bin string) {
	t.Helper()
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	built := harness.Binaries(t)
	for _, name := range []string{"broker", "syncer-agent", "tunnelctl"} {
		if err := os.Symlink(filepath.Join(built, name), filepath.Join(bin, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(harness.Grpcurl(t), filepath.Join(bin, "grpcurl")); err != nil {
		t.Fatal(err)
	}
}

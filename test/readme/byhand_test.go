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

// shellBlocks returns the ```sh blocks of the README's section named
// heading, in order.
func shellBlocks(t *testing.T, readme, heading string) []string {
	t.Helper()
	start := strings.Index(readme, "\n"+heading+"\n")
	if start < 0 {
		t.Fatalf("README.md has no %q section", heading)
	}
	body := readme[start+len(heading)+2:]
	if end := strings.Index(body, "\n## "); end >= 0 {
		body = body[:end]
	}
	blocks := regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllStringSubmatch(body, -1)
	var out []string
	for _, b := range blocks {
		out = append(out, b[1])
	}
	return out
}

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
	blocks := shellBlocks(t, string(raw), section)
	if len(blocks) < 4 {
		t.Fatalf("%q has %d shell blocks; want the setup, the parts, tunnelctl and grpcurl", section, len(blocks))
	}
	dir := t.TempDir()
	linkTools(t, filepath.Join(dir, "bin"))

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
		"1 agents",                  // tunnelctl agents
		"HTTP/1.0 200 OK",           // tunnelctl dial and port-forward, through the tunnel
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

package harness

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/kcp-dev/tunnel-broker/internal/version"
)

// RepoRoot is the top folder of this checkout.
func RepoRoot() string {
	_, self, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(self), "..", "..")
}

// Version is the tree's VERSION file, the version make stamps into binaries
// and images.
func Version(t T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(RepoRoot(), "VERSION"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// stampFlags are the -ldflags make passes, for binaries the tests build.
func stampFlags(t T) string {
	commit := version.Unknown
	if out, err := exec.Command("git", "-C", RepoRoot(), "rev-parse", "--short=12", "HEAD").Output(); err == nil {
		commit = strings.TrimSpace(string(out))
	}
	return version.Stamp(Version(t), commit)
}

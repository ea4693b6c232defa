package harness

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
)

var (
	helmBinOnce sync.Once
	helmBin     string
	helmBinErr  error
)

// HelmBinary returns the path of helm, built by test/tools/helm/build.sh at
// the version pinned there and cached in the repo's .cache/helm-<version>/:
// only the first call on a machine builds (a few minutes). $HELM, if it
// names an executable (make test exports the one helm-tools built), is
// taken as it is.
func HelmBinary() (string, error) {
	helmBinOnce.Do(func() {
		if h := os.Getenv("HELM"); h != "" {
			if st, err := os.Stat(h); err == nil && st.Mode()&0o111 != 0 {
				helmBin = h
				return
			}
		}
		_, self, _, ok := runtime.Caller(0)
		if !ok {
			helmBinErr = fmt.Errorf("cannot locate the harness source to find test/tools/helm")
			return
		}
		script := filepath.Join(filepath.Dir(self), "..", "tools", "helm", "build.sh")
		cmd := exec.Command(script)
		cmd.Stderr = os.Stderr // the build says what it does; go test shows it
		out, err := cmd.Output()
		if err != nil {
			helmBinErr = fmt.Errorf("%s: %w", script, err)
			return
		}
		helmBin = strings.TrimSpace(string(out))
	})
	return helmBin, helmBinErr
}

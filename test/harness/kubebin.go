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
	kubeBinOnce sync.Once
	kubeBinDir  string
	kubeBinErr  error
)

// KubeBinaries returns the folder that holds kube-apiserver and etcd, built
// by test/tools/kube/build.sh from the versions pinned there. The build is
// cached in the repo's .cache/kube/, so only the first call on a machine
// builds (many minutes); later ones find the binaries at once.
func KubeBinaries() (string, error) {
	kubeBinOnce.Do(func() { kubeBinDir, kubeBinErr = runBuildScript("kube") })
	return kubeBinDir, kubeBinErr
}

// runBuildScript runs test/tools/<tool>/build.sh, which builds the tool
// unless its build is cached, and returns the path the script prints.
func runBuildScript(tool string) (string, error) {
	_, self, _, ok := runtime.Caller(0)
	if !ok {
		return "", fmt.Errorf("cannot locate the harness source to find test/tools/%s", tool)
	}
	script := filepath.Join(filepath.Dir(self), "..", "tools", tool, "build.sh")
	cmd := exec.Command(script)
	cmd.Stderr = os.Stderr // the build says what it does; go test shows it
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w", script, err)
	}
	return strings.TrimSpace(string(out)), nil
}

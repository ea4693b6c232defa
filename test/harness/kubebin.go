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
	kubeBinOnce.Do(func() {
		_, self, _, ok := runtime.Caller(0)
		if !ok {
			kubeBinErr = fmt.Errorf("cannot locate the harness source to find test/tools/kube")
			return
		}
		script := filepath.Join(filepath.Dir(self), "..", "tools", "kube", "build.sh")
		cmd := exec.Command(script)
		cmd.Stderr = os.Stderr // the build says what it does; go test shows it
		out, err := cmd.Output()
		if err != nil {
			kubeBinErr = fmt.Errorf("%s: %w", script, err)
			return
		}
		kubeBinDir = strings.TrimSpace(string(out))
	})
	return kubeBinDir, kubeBinErr
}

package harness

import (
	"os/exec"
	"path/filepath"
)

var kcpTool = cachedTool{name: "kcp", script: "deploy/kcp/build.sh"}

// KCPBinary returns the path of the kcp an operator runs, built by
// deploy/kcp/build.sh: kcp at the version pinned in deploy/kcp/go.mod, with
// docs/kcp/webhook-tunnel.patch applied and the seam filled by kcpplugin
// from its --tunnel-* flags. The build is cached in the repo's .cache/kcp/,
// so only the first call on a machine (or after the patch, deploy/kcp or
// kcpplugin changed) builds, for many minutes; later ones find it at once.
func KCPBinary() (string, error) { return kcpTool.get() }

// DeployKcpTests runs go vet and the tests of deploy/kcp's module, against
// kcp's source with the patch (deploy/kcp/build.sh test), and returns what
// they printed.
func DeployKcpTests() (string, error) {
	out, err := exec.Command(filepath.Join(RepoRoot(), "deploy", "kcp", "build.sh"), "test").CombinedOutput()
	return string(out), err
}

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

// KCPSeamUnitTests runs kcp's own unit tests of the packages
// docs/kcp/webhook-tunnel.patch touches, in a patched copy of kcp's source
// (deploy/kcp/build.sh test), and returns what they printed.
func KCPSeamUnitTests() (string, error) {
	out, err := exec.Command(filepath.Join(RepoRoot(), "deploy", "kcp", "build.sh"), "test").CombinedOutput()
	return string(out), err
}

// KCPNewestSeamUnitTests checks the seam's port to the newest kcp release,
// which cannot be built here (deploy/kcp/build.sh newest): the patch
// applies to its source, and kcp's unit tests of the admission plugins and
// the conversion factory pass. It returns what they printed.
func KCPNewestSeamUnitTests() (string, error) {
	out, err := exec.Command(filepath.Join(RepoRoot(), "deploy", "kcp", "build.sh"), "newest").CombinedOutput()
	return string(out), err
}

// Package tools holds the modules that pin the heavy test tools (kube,
// helm, spire), each built by its build.sh into .cache/.
package tools

import (
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// toolPackages are the main packages each tool module's build.sh builds.
var toolPackages = map[string][]string{
	"kube":  {"k8s.io/kubernetes/cmd/kube-apiserver", "k8s.io/kubernetes/cmd/kubectl", "go.etcd.io/etcd/server/v3"},
	"helm":  {"helm.sh/helm/v4/cmd/helm"},
	"spire": {"github.com/spiffe/spire/cmd/spire-server", "github.com/spiffe/spire/cmd/spire-agent"},
}

// keptBack are the modules a tool builds at versions of its own, and why.
var keptBack = map[string]map[string]string{
	"spire": {
		"github.com/spiffe/go-spiffe/v2": "SPIRE v1.13.3's Workload API server implements go-spiffe v2.6.0's interface, which later versions extend",
		// gRPC past v1.82, and the genproto it needs, require go-spiffe v2.7.
		"google.golang.org/grpc":                    "needs go-spiffe v2.7 or later past v1.82",
		"google.golang.org/genproto/googleapis/api": "needs gRPC v1.83 or later at the workspace's version",
		"google.golang.org/genproto/googleapis/rpc": "needs gRPC v1.83 or later at the workspace's version",
	},
}

// TestToolsBuildTheWorkspacesVersionsOfWhatTheyShare checks that every
// module a tool's build shares with the workspace's (client-go, gRPC,
// protobuf, golang.org/x/...) is at the workspace's version. Go's build
// cache then compiles each such package once for both: the first make test
// on a fresh machine compiles Kubernetes' client libraries once rather than
// once per tool. The tools' build.sh build as go vet does (no -trimpath, no
// -race, cgo as the machine has it), so their compiled packages are the
// same. The fix for a mismatch is to raise the lower side: go get
// module@version in the tool's folder, or in the root and test modules;
// where the tool does not build with the workspace's version, keptBack
// says why.
func TestToolsBuildTheWorkspacesVersionsOfWhatTheyShare(t *testing.T) {
	root := harness.RepoRoot()
	workspace := modulesBuilt(t, root, nil, "-test", "./...", "./kcpplugin/...", "./proto/...", "./test/...")
	for tool, pkgs := range toolPackages {
		t.Run(tool, func(t *testing.T) {
			built := modulesBuilt(t, filepath.Join(root, "test", "tools", tool), []string{"GOWORK=off", "GOFLAGS=-mod=readonly"}, pkgs...)
			var differ []string
			for path, v := range built {
				if w, ok := workspace[path]; ok && w != v && keptBack[tool][path] == "" {
					differ = append(differ, path+" "+v+" (the workspace: "+w+")")
				}
			}
			sort.Strings(differ)
			if len(differ) > 0 {
				t.Errorf("%s builds %d modules the workspace also builds at other versions, so a first make test compiles them, and everything above them, twice:\n  %s",
					tool, len(differ), strings.Join(differ, "\n  "))
			}
			for path := range keptBack[tool] {
				if built[path] == workspace[path] {
					t.Errorf("keptBack names %s for %s, which builds it at the workspace's version (%s) now: drop it", path, tool, built[path])
				}
			}
			if len(built) == 0 {
				t.Errorf("%s builds no module: go list found nothing", tool)
			}
		})
	}
}

// modulesBuilt maps each module that provides a package of pkgs' builds,
// listed in dir, to its version.
func modulesBuilt(t *testing.T, dir string, env []string, pkgs ...string) map[string]string {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list", "-deps", "-f", "{{with .Module}}{{.Path}} {{with .Replace}}{{.Version}}{{else}}{{.Version}}{{end}}{{end}}"}, pkgs...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list in %s: %v", dir, err)
	}
	mods := map[string]string{}
	for _, line := range strings.Split(string(out), "\n") {
		if path, v, ok := strings.Cut(line, " "); ok && v != "" {
			mods[path] = v
		}
	}
	return mods
}

package release

import (
	"bufio"
	"encoding/json"
	"fmt"
	gover "go/version"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/semver"

	"github.com/kcp-dev/tunnel-broker/internal/release"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// kcpReleases are the kcp releases kcpplugin is linked into: v0.28.1, whose
// requirements are kcpplugin's floor, and two newer ones, each on a newer
// fork of Kubernetes. kcp requires modules of its own repository through replace
// directives to its folders (./sdk, ./staging/src/github.com/kcp-dev/...),
// which do not apply to a module that requires kcp; published stands in for
// them with the modules published from those folders at the release's tags.
var kcpReleases = []struct {
	version   string
	published []module.Version
	// proxyRefuses is a module the release needs that the module proxy of
	// this project's machines refuses to serve (403): while it does, the
	// release's module graph cannot be computed and the release is skipped,
	// naming the module. Any other failure fails the test.
	proxyRefuses string
}{
	{version: "v0.28.1", published: []module.Version{
		{Path: "github.com/kcp-dev/kcp/sdk", Version: "v0.28.1"},
	}},
	{version: "v0.30.0", published: []module.Version{
		{Path: "github.com/kcp-dev/apimachinery/v2", Version: "v2.30.0"},
		{Path: "github.com/kcp-dev/client-go", Version: "v0.30.0"},
		{Path: "github.com/kcp-dev/code-generator/v3", Version: "v3.30.0"},
		{Path: "github.com/kcp-dev/sdk", Version: "v0.30.0"},
	}},
	{version: "v0.32.3", published: []module.Version{
		{Path: "github.com/kcp-dev/apimachinery/v2", Version: "v2.32.3"},
		{Path: "github.com/kcp-dev/client-go", Version: "v0.32.3"},
		{Path: "github.com/kcp-dev/code-generator/v3", Version: "v3.32.3"},
		{Path: "github.com/kcp-dev/sdk", Version: "v0.32.3"},
		{Path: "github.com/kcp-dev/virtual-workspace-framework", Version: "v0.32.3"},
	}, proxyRefuses: "github.com/kcp-dev/virtual-workspace-framework"},
}

// TestKcppluginRaisesNothingInKcp adds kcpplugin, as this work tree has it,
// to a module that requires each kcp release the way kcp's own go.mod does
// (its requirements and its replace directives, which put k8s.io/* on kcp's
// fork of Kubernetes), and checks that every module kcp already had keeps
// its version and that the go directive stays kcp's: kcp links kcpplugin,
// and a kcpplugin that raised gRPC, protobuf or the Go version would force
// kcp to upgrade them to take it. Only go.mod files are read; nothing is
// built.
func TestKcppluginRaisesNothingInKcp(t *testing.T) {
	for _, kcp := range kcpReleases {
		t.Run(kcp.version, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			kcpMod := kcpGoMod(t, dir, kcp.version)
			scratch := kcpShaped(t, kcpMod, kcp.version, kcp.published)
			writeGoMod(t, dir, scratch)
			sums := filepath.Join("testdata", "kcp", kcp.version, "go.sum")
			pinned, err := os.ReadFile(sums)
			if err != nil && !os.IsNotExist(err) {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, "go.sum"), pinned, 0o644); err != nil {
				t.Fatal(err)
			}

			before, refused := moduleGraph(t, dir, kcp.proxyRefuses)
			if refused != "" {
				checkRequirements(t, kcpMod, kcp.version)
				t.Skipf("the module proxy refuses %s, which kcp %s needs: its module graph cannot be computed here, so only kcpplugin's and proto's go.mod were compared with kcp's", refused, kcp.version)
			}
			// The module reproduces kcp's graph: each module kcp requires is
			// selected at kcp's version, and the go directive stays kcp's.
			if got := readGoMod(t, dir).Go.Version; got != kcpMod.Go.Version {
				t.Errorf("without kcpplugin, the go directive is %s, but kcp %s's is %s: the module does not reproduce kcp's graph",
					got, kcp.version, kcpMod.Go.Version)
			}
			for _, r := range kcpMod.Require {
				if v, ok := before[r.Mod.Path]; ok && r.Mod.Version != v.version && !replacedByFolder(kcpMod, r.Mod.Path) {
					t.Errorf("without kcpplugin, %s is at %s, but kcp %s requires %s: the module does not reproduce kcp's graph",
						r.Mod.Path, v.version, kcp.version, r.Mod.Version)
				}
			}

			root := harness.RepoRoot()
			withPlugin := kcpShaped(t, kcpMod, kcp.version, kcp.published)
			const zero = "v0.0.0-00010101000000-000000000000" // any version: the replace picks the folder
			if err := withPlugin.AddRequire(release.Root+"/kcpplugin", zero); err != nil {
				t.Fatal(err)
			}
			for _, m := range []string{"kcpplugin", "proto"} {
				if err := withPlugin.AddReplace(release.Root+"/"+m, "", filepath.Join(root, m), ""); err != nil {
					t.Fatal(err)
				}
			}
			writeGoMod(t, dir, withPlugin)
			after, _ := moduleGraph(t, dir, "")

			var moved []string
			for path, v := range before {
				if a := after[path]; a != v {
					moved = append(moved, fmt.Sprintf("%s %s -> %s", path, v, a))
				}
			}
			sort.Strings(moved)
			if len(moved) > 0 {
				t.Errorf("adding kcpplugin to kcp %s moves %d of kcp's modules (kcpplugin/go.mod or proto/go.mod asks for more than kcp has):\n\t%s",
					kcp.version, len(moved), strings.Join(moved, "\n\t"))
			}
			if got := readGoMod(t, dir).Go.Version; got != kcpMod.Go.Version {
				t.Errorf("adding kcpplugin to kcp %s raises the go directive from %s to %s", kcp.version, kcpMod.Go.Version, got)
			}
			checkPinnedSums(t, dir, sums, pinned)
		})
	}
}

// kcpGoMod is the go.mod of kcp at version, from the module proxy.
func kcpGoMod(t *testing.T, dir, version string) *modfile.File {
	t.Helper()
	out, _ := goCommand(t, dir, "", "list", "-m", "-json", "github.com/kcp-dev/kcp@"+version)
	var m struct{ GoMod string }
	if err := json.Unmarshal(out, &m); err != nil || m.GoMod == "" {
		t.Fatalf("go list -m -json github.com/kcp-dev/kcp@%s: no go.mod (%v):\n%s", version, err, out)
	}
	data, err := os.ReadFile(m.GoMod)
	if err != nil {
		t.Fatal(err)
	}
	f, err := modfile.Parse(m.GoMod, data, nil)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// kcpShaped is a go.mod that requires kcp at version with kcp's go
// directive and its replace directives, except those to kcp's own folders,
// whose modules published requires instead.
func kcpShaped(t *testing.T, kcpMod *modfile.File, version string, published []module.Version) *modfile.File {
	t.Helper()
	f := new(modfile.File)
	for _, err := range []error{
		f.AddModuleStmt("example.com/kcp"),
		f.AddGoStmt(kcpMod.Go.Version),
		f.AddRequire("github.com/kcp-dev/kcp", version),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	stands := map[string]bool{}
	for _, m := range published {
		if err := f.AddRequire(m.Path, m.Version); err != nil {
			t.Fatal(err)
		}
		stands[m.Path] = true
	}
	for _, r := range kcpMod.Replace {
		if modfile.IsDirectoryPath(r.New.Path) {
			if !stands[r.Old.Path] {
				t.Fatalf("kcp %s replaces %s with its folder %s: name the published module in kcpReleases", version, r.Old.Path, r.New.Path)
			}
			continue
		}
		if err := f.AddReplace(r.Old.Path, r.Old.Version, r.New.Path, r.New.Version); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

func replacedByFolder(f *modfile.File, path string) bool {
	for _, r := range f.Replace {
		if r.Old.Path == path && modfile.IsDirectoryPath(r.New.Path) {
			return true
		}
	}
	return false
}

func writeGoMod(t *testing.T, dir string, f *modfile.File) {
	t.Helper()
	f.Cleanup()
	data, err := f.Format()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func readGoMod(t *testing.T, dir string) *modfile.File {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	f, err := modfile.Parse("go.mod", data, nil)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// selected is a module's selected version and, if it is replaced, what
// replaces it.
type selected struct{ version, replacement string }

func (s selected) String() string {
	if s.replacement == "" {
		return s.version
	}
	return s.version + " => " + s.replacement
}

// moduleGraph is go list -m all in dir: every module of the build list
// with its selected version; or, if the module proxy refused to serve
// module refusable, which module version it refused.
func moduleGraph(t *testing.T, dir, refusable string) (graph map[string]selected, refused string) {
	t.Helper()
	out, refused := goCommand(t, dir, refusable, "list", "-m", "all")
	if refused != "" {
		return nil, refused
	}
	graph = map[string]selected{}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue // the main module
		}
		s := selected{version: f[1]}
		if len(f) > 3 && f[2] == "=>" {
			s.replacement = strings.Join(f[3:], " ")
		}
		graph[f[0]] = s
	}
	return graph, ""
}

// refusal is the go command's report of a module version the module proxy
// refused to serve.
var refusal = regexp.MustCompile(`(?m)^go: (?:[^ ]+: )*([^ @]+)@([^ :]+): reading [^ ]+: (403 Forbidden|404 Not Found|410 Gone)`)

// goCommand runs the go command in dir on go.mod files alone: no
// workspace, go.mod and go.sum updated as needed, the local toolchain.
// GONOSUMDB: the checksum database does not know some of kcp's own
// modules; testdata/kcp/<version>/go.sum pins what they were when this
// test was written. If the module proxy refuses to serve the module
// refusable, it returns which version of it; anything else that goes wrong
// fails the test.
func goCommand(t *testing.T, dir, refusable string, args ...string) (out []byte, refused string) {
	t.Helper()
	var env []string
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case "GOWORK", "GOFLAGS", "GONOSUMDB", "GONOSUMCHECK", "GOTOOLCHAIN":
			continue
		}
		env = append(env, kv)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(env, "GOWORK=off", "GOFLAGS=-mod=mod", "GONOSUMDB=github.com/kcp-dev", "GOTOOLCHAIN=local")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		for _, m := range refusal.FindAllStringSubmatch(stderr.String(), -1) {
			if refusable != "" && m[1] == refusable {
				return nil, fmt.Sprintf("%s@%s (%s)", m[1], m[2], m[3])
			}
		}
		t.Fatalf("go %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return out, ""
}

// checkRequirements compares kcpplugin's and proto's go.mod with kcp's
// directly, for a release whose module graph cannot be computed: no module
// both require may be newer in theirs, nor their go directive. kcp's
// go.mod lists every module its build selects, and kcpplugin's every module
// kcpplugin's needs, so this catches what the graph would, except a module
// kcp's graph has that its go.mod does not list.
func checkRequirements(t *testing.T, kcpMod *modfile.File, version string) {
	t.Helper()
	kcpHas := map[string]string{}
	for _, r := range kcpMod.Require {
		kcpHas[r.Mod.Path] = r.Mod.Version
	}
	for _, m := range []string{"kcpplugin", "proto"} {
		f := readGoMod(t, filepath.Join(harness.RepoRoot(), m))
		if gover.Compare("go"+f.Go.Version, "go"+kcpMod.Go.Version) > 0 {
			t.Errorf("%s/go.mod asks for go %s, above kcp %s's go %s", m, f.Go.Version, version, kcpMod.Go.Version)
		}
		for _, r := range f.Require {
			if v, ok := kcpHas[r.Mod.Path]; ok && semver.Compare(r.Mod.Version, v) > 0 {
				t.Errorf("%s/go.mod requires %s %s, above kcp %s's %s", m, r.Mod.Path, r.Mod.Version, version, v)
			}
		}
	}
}

// checkPinnedSums fails if the go command had to add a checksum of one of
// kcp's own modules to go.sum: the checksum database does not vouch for
// them, so testdata's go.sum must, and it lacks these.
func checkPinnedSums(t *testing.T, dir, sums string, pinned []byte) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, line := range strings.Split(string(pinned), "\n") {
		have[line] = true
	}
	var missing []string
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "github.com/kcp-dev/") && !have[line] {
			missing = append(missing, line)
		}
	}
	if len(missing) > 0 {
		t.Errorf("%s lacks the checksums of %d of kcp's modules, which the checksum database does not check; if they are what kcp's repository publishes, add them:\n%s",
			sums, len(missing), strings.Join(missing, "\n"))
	}
}

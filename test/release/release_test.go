package release

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"golang.org/x/mod/modfile"

	"github.com/kcp-dev/tunnel-broker/internal/release"
	"github.com/kcp-dev/tunnel-broker/internal/release/image"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestReleaseTagsOneStampedCommitAndPushesNothing runs make release in a
// copy of this work tree, a git repository of its own with a remote, with
// no checks (the release check and the rest of make test are tested
// elsewhere).
func TestReleaseTagsOneStampedCommitAndPushesNothing(t *testing.T) {
	const version, next = "v0.7.0", "v0.7.1-dev"
	repo, origin := copyWorkTree(t)

	out := mustRun(t, repo, "make", "release", "VERSION="+version, "RELEASE_CHECKS=")
	t.Logf("make release:\n%s", out)

	checkModuleTags(t, repo, version)
	checkStampedCommit(t, repo, version)

	// After the release, main says what comes next.
	if got := strings.TrimSpace(showAt(t, repo, "HEAD", "VERSION")); got != next {
		t.Errorf("VERSION after the release: %s, want %s", got, next)
	}
	if chart := showAt(t, repo, "HEAD", "deploy/charts/tunnel-agent/Chart.yaml"); !strings.Contains(chart, `appVersion: "`+next+`"`) {
		t.Errorf("the agent's chart after the release is not at %s:\n%s", next, chart)
	}
	if values := showAt(t, repo, "HEAD", "deploy/kcp/values-kcp-chart.yaml"); !strings.Contains(values, "\n  tag: "+next+"\n") {
		t.Errorf("deploy/kcp's values for kcp's chart after the release do not run %s:\n%s", next, values)
	}
	if status := mustRun(t, repo, "git", "status", "--porcelain"); status != "" {
		t.Errorf("make release left changes behind:\n%s", status)
	}

	checkReleaseImages(t, repo, version)

	// From now on, buf breaking compares proto/ with this release.
	if lint := mustRun(t, repo, "make", "-n", "lint"); !strings.Contains(lint, "--against '.git#ref=proto/"+version+"'") {
		t.Errorf("make lint after the release does not compare proto/ with proto/%s:\n%s", version, lint)
	}

	if refs := mustRun(t, origin, "git", "for-each-ref"); refs != "" {
		t.Errorf("make release pushed:\n%s", refs)
	}

	// Once released, the version is taken.
	if out, err := runIn(repo, "make", "release", "VERSION="+version, "RELEASE_CHECKS="); err == nil || !strings.Contains(out, "exists already") {
		t.Errorf("releasing %s again: %v\n%s", version, err, out)
	}
}

// showAt is file at revision rev of repo.
func showAt(t *testing.T, repo, rev, file string) string {
	t.Helper()
	return mustRun(t, repo, "git", "show", rev+":"+file)
}

// checkModuleTags checks that every module's tag of version is on the
// release commit, the one before HEAD.
func checkModuleTags(t *testing.T, repo, version string) {
	t.Helper()
	released := strings.TrimSpace(mustRun(t, repo, "git", "rev-parse", "HEAD~1"))
	for _, m := range release.Modules {
		at := strings.TrimSpace(mustRun(t, repo, "git", "rev-parse", m.Tag(version)+"^{commit}"))
		if at != released {
			t.Errorf("tag %s is on %s, want the release commit %s", m.Tag(version), at, released)
		}
	}
}

// checkStampedCommit checks what the release commit says of version: in
// VERSION, in the modules' requirements of each other, in the production
// overlay and in the changelog.
func checkStampedCommit(t *testing.T, repo, version string) {
	t.Helper()
	if got := strings.TrimSpace(showAt(t, repo, version, "VERSION")); got != version {
		t.Errorf("VERSION at the release: %s", got)
	}
	for file, wants := range map[string][]string{
		"kcpplugin/go.mod": {release.Root + "/proto"},
		"go.mod":           {release.Root + "/proto", release.Root + "/kcpplugin"},
	} {
		f, err := modfile.Parse(file, []byte(showAt(t, repo, version, file)), nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range wants {
			found := false
			for _, r := range f.Require {
				if r.Mod.Path == want {
					found = r.Mod.Version == version
				}
			}
			if !found {
				t.Errorf("%s at the release does not require %s %s", file, want, version)
			}
		}
	}
	if overlay := showAt(t, repo, version, "deploy/overlays/production/kustomization.yaml"); !strings.Contains(overlay, "newTag: "+version) {
		t.Errorf("the production overlay at the release does not deploy %s:\n%s", version, overlay)
	}
	if chart := showAt(t, repo, version, "deploy/charts/tunnel-broker/Chart.yaml"); !strings.Contains(chart, `appVersion: "`+version+`"`) ||
		!strings.Contains(chart, "version: "+strings.TrimPrefix(version, "v")+"\n") {
		t.Errorf("the broker's chart at the release does not deploy %s:\n%s", version, chart)
	}
	if values := showAt(t, repo, version, "deploy/kcp/values-kcp-chart.yaml"); !strings.Contains(values, "\n  tag: "+version+"\n") {
		t.Errorf("deploy/kcp's values for kcp's chart at the release do not run tunnel-kcp's tag %s:\n%s", version, values)
	}
	if changelog := showAt(t, repo, version, "CHANGELOG.md"); !strings.Contains(changelog, "## Unreleased\n\n## "+version+" (") {
		t.Errorf("CHANGELOG.md at the release has no section for %s under a new Unreleased one", version)
	}
}

// checkReleaseImages checks that bin/images/oci holds every image of the
// release, tagged version.
func checkReleaseImages(t *testing.T, repo, version string) {
	t.Helper()
	oci, err := layout.FromPath(filepath.Join(repo, "bin", "images", "oci"))
	if err != nil {
		t.Fatal(err)
	}
	ii, err := oci.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	index, err := ii.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, d := range index.Manifests {
		names[d.Annotations[image.RefNameAnnotation]] = true
	}
	for _, name := range release.Images {
		if !names[name+":"+version] {
			t.Errorf("no image %s:%s in bin/images/oci (%v)", name, version, names)
		}
	}
}

func TestReleaseRefusesADirtyTreeAndLeavesItAlone(t *testing.T) {
	repo, _ := copyWorkTree(t)
	if err := os.WriteFile(filepath.Join(repo, "README.md"), []byte("changed\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := runIn(repo, "make", "release", "VERSION=v0.7.0", "RELEASE_CHECKS=")
	if err == nil || !strings.Contains(out, "commit or stash") {
		t.Fatalf("make release on a dirty tree: %v\n%s", err, out)
	}
	if tags := mustRun(t, repo, "git", "tag"); tags != "" {
		t.Errorf("tags made: %s", tags)
	}
	if got := mustRun(t, repo, "git", "status", "--porcelain"); got != " M README.md\n" {
		t.Errorf("git status after the refusal:\n%s", got)
	}
}

// copyWorkTree copies the files of this work tree that git tracks or would
// track into a new git repository, committed on main, with an empty bare
// repository as its origin.
func copyWorkTree(t *testing.T) (repo, origin string) {
	t.Helper()
	root := harness.RepoRoot()
	dir := t.TempDir()
	repo, origin = filepath.Join(dir, "repo"), filepath.Join(dir, "origin.git")
	files := mustRun(t, root, "git", "ls-files", "-z", "--cached", "--others", "--exclude-standard")
	for _, name := range strings.Split(files, "\x00") {
		if name == "" {
			continue
		}
		data, err := os.ReadFile(filepath.Join(root, name))
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		info, err := os.Stat(filepath.Join(root, name))
		if err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(repo, name)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dst, data, info.Mode().Perm()); err != nil {
			t.Fatal(err)
		}
	}
	mustRun(t, dir, "git", "init", "-q", "--bare", origin)
	for _, argv := range [][]string{
		{"git", "init", "-q", "-b", "main"},
		{"git", "config", "user.email", "release@tunnel.test"},
		{"git", "config", "user.name", "release test"},
		{"git", "remote", "add", "origin", origin},
		{"git", "add", "-A"},
		{"git", "commit", "-q", "-m", "the work tree"},
	} {
		mustRun(t, repo, argv...)
	}
	return repo, origin
}

func runIn(dir string, argv ...string) (string, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = dir
	// The copy is a module tree of its own: its go.work, not the caller's.
	cmd.Env = append(os.Environ(), "GOWORK=", "TUNNEL_BIN_DIR=", "GOFLAGS=-buildvcs=false")
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func mustRun(t *testing.T, dir string, argv ...string) string {
	t.Helper()
	out, err := runIn(dir, argv...)
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(argv, " "), err, out)
	}
	return out
}

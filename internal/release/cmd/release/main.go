// Command release makes a release of this repository in the local clone,
// and pushes nothing (make release VERSION=vX.Y.Z):
//
//  1. it refuses a dirty tree, a version that is not vX.Y.Z (or vX.Y.Z-rc.N),
//     a tag that exists already, and an empty "Unreleased" in CHANGELOG.md;
//  2. it stamps the version into VERSION, the modules' requirements on each
//     other, the overlays' image tags, the charts' versions and CHANGELOG.md;
//  3. it runs the checks (make test by default: lint with buf breaking
//     against the last release, every test, and the release check, which
//     serves the modules at this version to a consumer outside the repo);
//     if they fail, it puts the files back and stops;
//  4. it commits "Release vX.Y.Z" and tags it proto/vX.Y.Z,
//     kcpplugin/vX.Y.Z and vX.Y.Z;
//  5. it builds the images (make images) from that commit;
//  6. it commits the next -dev version to VERSION, the overlays and the charts;
//  7. it prints what to push.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/mod/semver"

	"github.com/kcp-dev/tunnel-broker/internal/release"
)

// stampedFiles are what release.StampTree changes.
var stampedFiles = []string{"VERSION", "go.mod", "kcpplugin/go.mod", "proto/go.mod", "deploy/kcp/go.mod", release.KcpChartValues, "deploy/overlays", "deploy/charts"}

func main() {
	var (
		version = flag.String("version", "", "the release, vX.Y.Z")
		checks  = flag.String("checks", "test", "make targets to run on the stamped tree before tagging (space-separated; \"\" for none)")
		repo    = flag.String("repo", ".", "the repository's top folder")
	)
	flag.Parse()
	if err := run(*repo, *version, strings.Fields(*checks)); err != nil {
		fmt.Fprintln(os.Stderr, "release:", err)
		os.Exit(1)
	}
}

func run(repo, version string, checks []string) error {
	if err := refuse(repo, version); err != nil {
		return err
	}
	if err := stampAndCheck(repo, version, checks); err != nil {
		return err
	}
	tags, commit, err := commitAndTag(repo, version)
	if err != nil {
		return err
	}

	step("building the images of %s", version)
	if err := makeTargets(repo, version, "images"); err != nil {
		return fmt.Errorf("%s is tagged, but the images failed to build (make images VERSION=%s retries): %w", version, version, err)
	}

	next := nextDev(version)
	step("opening %s", next)
	if err := release.SetVersion(repo, next); err != nil {
		return err
	}
	if _, err := git(repo, "commit", "-m", "Open "+next, "--", "VERSION", release.KcpChartValues, "deploy/overlays", "deploy/charts"); err != nil {
		return err
	}

	fmt.Printf(`
Released %s at %s, tagged %s.
Images: bin/images/oci, bin/images/broker.tar, bin/images/syncer-agent.tar, bin/images/kcp.tar, bin/images/tunnelctl.tar.
Nothing was pushed. To publish:

  git push origin HEAD %s
  skopeo copy oci-archive:bin/images/broker.tar docker://<registry>/kcp-dev/tunnel-broker:%s
  skopeo copy oci-archive:bin/images/syncer-agent.tar docker://<registry>/kcp-dev/tunnel-syncer-agent:%s
  skopeo copy oci-archive:bin/images/kcp.tar docker://<registry>/kcp-dev/tunnel-kcp:%s
  skopeo copy oci-archive:bin/images/tunnelctl.tar docker://<registry>/kcp-dev/tunnelctl:%s
`, version, commit[:12], strings.Join(tags, ", "), strings.Join(tags, " "), version, version, version, version)
	return nil
}

// refuse says why version cannot be released from repo, if it cannot: a
// version that is not vX.Y.Z or vX.Y.Z-rc.N, a dirty tree, or a tag that
// exists already.
func refuse(repo, version string) error {
	if err := release.CheckVersion(version); err != nil {
		return err
	}
	if pre := semver.Prerelease(version); pre != "" && !strings.HasPrefix(pre, "-rc.") {
		return fmt.Errorf("version %s: a release is vX.Y.Z or vX.Y.Z-rc.N", version)
	}
	if out, err := git(repo, "status", "--porcelain"); err != nil || out != "" {
		return fmt.Errorf("the work tree has changes; commit or stash them first:\n%s%v", out, errOrNil(err))
	}
	for _, m := range release.Modules {
		if _, err := git(repo, "rev-parse", "-q", "--verify", "refs/tags/"+m.Tag(version)); err == nil {
			return fmt.Errorf("tag %s exists already", m.Tag(version))
		}
	}
	return nil
}

// stampAndCheck stamps version into the tree and CHANGELOG.md (refusing an
// empty "Unreleased"), and runs the checks on it. If anything fails, it
// puts the files back.
func stampAndCheck(repo, version string, checks []string) error {
	changelog := filepath.Join(repo, "CHANGELOG.md")
	text, err := os.ReadFile(changelog)
	if err != nil {
		return err
	}
	stamped, err := release.StampChangelog(string(text), version, time.Now().UTC().Format("2006-01-02"))
	if err != nil {
		return err
	}

	step("stamping %s into VERSION, the go.mod files, the overlays, the charts and CHANGELOG.md", version)
	if err := release.StampTree(repo, version); err != nil {
		return restore(repo, err)
	}
	if err := os.WriteFile(changelog, []byte(stamped), 0o644); err != nil {
		return restore(repo, err)
	}
	if len(checks) > 0 {
		step("checking the release: make %s", strings.Join(checks, " "))
		if err := makeTargets(repo, version, checks...); err != nil {
			return restore(repo, fmt.Errorf("the checks failed, nothing was committed or tagged: %w", err))
		}
	}
	return nil
}

// commitAndTag commits the stamped tree and tags it once per module. It
// returns the tags and the commit.
func commitAndTag(repo, version string) (tags []string, commit string, err error) {
	step("committing and tagging")
	if _, err := git(repo, append([]string{"commit", "-m", "Release " + version, "--", "CHANGELOG.md"}, stampedFiles...)...); err != nil {
		return nil, "", restore(repo, err)
	}
	for _, m := range release.Modules {
		tag := m.Tag(version)
		if _, err := git(repo, "tag", "-a", "-m", "Release "+version+" of "+m.Path, tag); err != nil {
			return nil, "", err
		}
		tags = append(tags, tag)
	}
	commit, err = git(repo, "rev-parse", "HEAD")
	return tags, strings.TrimSpace(commit), err
}

// nextDev is the -dev version after a release: the next patch.
func nextDev(version string) string {
	v := strings.TrimPrefix(semver.Canonical(version), "v")
	v = strings.SplitN(v, "-", 2)[0]
	var major, minor, patch int
	fmt.Sscanf(v, "%d.%d.%d", &major, &minor, &patch)
	if semver.Prerelease(version) != "" {
		return fmt.Sprintf("v%d.%d.%d-dev", major, minor, patch) // after an rc, the release itself
	}
	return fmt.Sprintf("v%d.%d.%d-dev", major, minor, patch+1)
}

func step(format string, args ...any) {
	fmt.Printf("release: "+format+"\n", args...)
}

// restore puts back the files the release stamped.
func restore(repo string, err error) error {
	if _, rerr := git(repo, "checkout", "--", "."); rerr != nil {
		return fmt.Errorf("%w (and restoring the files failed: %v)", err, rerr)
	}
	return err
}

func git(repo string, args ...string) (string, error) {
	cmd := exec.Command("git", append([]string{"-C", repo}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func makeTargets(repo, version string, targets ...string) error {
	cmd := exec.Command("make", append([]string{"-C", repo, "VERSION=" + version}, targets...)...)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	return cmd.Run()
}

func errOrNil(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

package release

import (
	"os"
	"path/filepath"
	"slices"
)

// BuiltModules are the folders of the modules that are not published but
// built from the tree outside go.work (deploy/kcp, kcp with kcpplugin):
// their requirements on the published modules are stamped too, so that
// they agree with what kcpplugin requires at the release.
var BuiltModules = []string{"deploy/kcp"}

// StampTree sets the version of the tree at repo: the VERSION file, the
// requirements between the published modules, and theirs in BuiltModules
// (StampGoMod), the image tags of the overlays (StampOverlays) and of
// deploy/kcp's values for kcp's chart (StampKcpChartValues), and the
// charts' versions (StampCharts).
func StampTree(repo, version string) error {
	dirs := slices.Clone(BuiltModules)
	for _, m := range Modules {
		dirs = append(dirs, m.Dir)
	}
	for _, dir := range dirs {
		f := filepath.Join(repo, dir, "go.mod")
		data, err := os.ReadFile(f)
		if err != nil {
			return err
		}
		stamped, err := StampGoMod(f, data, version)
		if err != nil {
			return err
		}
		if err := os.WriteFile(f, stamped, 0o644); err != nil {
			return err
		}
	}
	return SetVersion(repo, version)
}

// SetVersion sets the VERSION file, the image tags and the charts'
// versions, but not the modules' requirements: for the -dev version
// that follows a release, whose modules still require each other at the
// release.
func SetVersion(repo, version string) error {
	if err := os.WriteFile(filepath.Join(repo, "VERSION"), []byte(version+"\n"), 0o644); err != nil {
		return err
	}
	if err := StampOverlays(repo, version); err != nil {
		return err
	}
	if err := StampKcpChartValues(repo, version); err != nil {
		return err
	}
	return StampCharts(repo, version)
}

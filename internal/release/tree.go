package release

import (
	"os"
	"path/filepath"
)

// StampTree sets the version of the tree at repo: the VERSION file, the
// requirements between the published modules (StampGoMod), the image
// tags of the overlays (StampOverlays) and the charts' versions
// (StampCharts).
func StampTree(repo, version string) error {
	if err := os.WriteFile(filepath.Join(repo, "VERSION"), []byte(version+"\n"), 0o644); err != nil {
		return err
	}
	for _, m := range Modules {
		f := filepath.Join(repo, m.Dir, "go.mod")
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
	if err := StampOverlays(repo, version); err != nil {
		return err
	}
	return StampCharts(repo, version)
}

// SetVersion sets the VERSION file, the overlays' image tags and the
// charts' versions, but not the modules' requirements: for the -dev version
// that follows a release, whose modules still require each other at the
// release.
func SetVersion(repo, version string) error {
	if err := os.WriteFile(filepath.Join(repo, "VERSION"), []byte(version+"\n"), 0o644); err != nil {
		return err
	}
	if err := StampOverlays(repo, version); err != nil {
		return err
	}
	return StampCharts(repo, version)
}

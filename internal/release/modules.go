// Package release knows this repository's published Go modules: it stamps
// their go.mod files with a release version and serves them as a Go module
// proxy would, so that a release can be checked the way a consumer meets
// it before anything is tagged or pushed.
package release

import (
	"fmt"
	"path"
	"strings"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/semver"
)

// Module is one of this repository's published modules.
type Module struct {
	// Path is the module path.
	Path string
	// Dir is the module's folder in the repository, "." for the top one.
	Dir string
}

// Root is the module path of the repository's top module.
const Root = "github.com/kcp-dev/tunnel-broker"

// Modules are released together, each tagged with the same version: the
// wire API (proto), the library kcp links (kcpplugin, which requires
// proto) and the binaries' module (the root, which requires both). The
// test module is never published.
var Modules = []Module{
	{Path: Root + "/proto", Dir: "proto"},
	{Path: Root + "/kcpplugin", Dir: "kcpplugin"},
	{Path: Root, Dir: "."},
}

// Tag is the git tag that publishes m at version: the version itself for
// the top module, and prefixed with the module's folder for the others
// (proto/v0.1.0), as the go command looks them up.
func (m Module) Tag(version string) string {
	if m.Dir == "." {
		return version
	}
	return path.Join(m.Dir, version)
}

// CheckVersion refuses what cannot be a version of these modules: a
// canonical semantic version with major version 0 or 1 (a v2 would need
// /v2 module paths), without build metadata.
func CheckVersion(version string) error {
	if !semver.IsValid(version) || semver.Canonical(version) != version {
		return fmt.Errorf("version %q is not a canonical semantic version such as v0.1.0", version)
	}
	if major := semver.Major(version); major != "v0" && major != "v1" {
		return fmt.Errorf("version %q: a major version above v1 needs /%s module paths", version, major)
	}
	return module.Check(Root, version)
}

// StampGoMod sets every requirement of a go.mod on one of Modules to
// version, so that the released modules require each other at the version
// they are released with. It leaves everything else as it is; replace
// directives, which only the top module has, are for building in this
// repository and are ignored by the go command in any other module.
func StampGoMod(name string, data []byte, version string) ([]byte, error) {
	f, err := modfile.Parse(name, data, nil)
	if err != nil {
		return nil, err
	}
	for _, r := range f.Require {
		if isOurs(r.Mod.Path) {
			if err := f.AddRequire(r.Mod.Path, version); err != nil {
				return nil, err
			}
		}
	}
	f.Cleanup()
	return f.Format()
}

func isOurs(modPath string) bool {
	return modPath == Root || strings.HasPrefix(modPath, Root+"/")
}

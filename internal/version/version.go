// Package version tells which build a binary is: the release version, the
// commit and the Go version it was built with. make stamps the first two
// with -ldflags (see Stamp); a plain go build falls back to what the Go
// toolchain recorded in the binary (runtime/debug.ReadBuildInfo).
package version

import (
	"fmt"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
)

// Set by the linker: go build -ldflags "-X <this package>.version=v0.1.0
// -X <this package>.commit=5570f66c1a2b". Stamp spells the flags out.
var (
	version string
	commit  string
)

// Unknown stands for a version or commit nothing recorded.
const Unknown = "unknown"

// Info is what a binary knows about its build.
type Info struct {
	// Version is the release version (the VERSION file of the tree when
	// stamped; a module version or pseudo-version when go built it from a
	// module or a git checkout), or Unknown.
	Version string
	// Commit is the git commit, with "-dirty" if the tree had uncommitted
	// changes, or Unknown.
	Commit string
	// GoVersion is the Go release that compiled the binary.
	GoVersion string
}

// Get is this binary's Info.
func Get() Info {
	bi, _ := debug.ReadBuildInfo()
	return resolve(version, commit, bi)
}

// resolve prefers what was stamped, then what the toolchain recorded.
func resolve(stampedVersion, stampedCommit string, bi *debug.BuildInfo) Info {
	info := Info{Version: stampedVersion, Commit: stampedCommit, GoVersion: runtime.Version()}
	if bi == nil {
		bi = &debug.BuildInfo{}
	}
	if bi.GoVersion != "" {
		info.GoVersion = bi.GoVersion
	}
	if info.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		// go install module@version, or Go 1.24+ building in a git
		// checkout: a tag or a pseudo-version derived from the commit.
		info.Version = bi.Main.Version
	}
	if info.Commit == "" {
		var revision, modified string
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				revision = s.Value
			case "vcs.modified":
				modified = s.Value
			}
		}
		if len(revision) > 12 {
			revision = revision[:12]
		}
		if revision != "" && modified == "true" {
			revision += "-dirty"
		}
		info.Commit = revision
	}
	if info.Version == "" {
		info.Version = Unknown
	}
	if info.Commit == "" {
		info.Commit = Unknown
	}
	return info
}

// String is what --version prints after the binary's name.
func (i Info) String() string {
	return fmt.Sprintf("%s (commit %s, %s)", i.Version, i.Commit, i.GoVersion)
}

// Stamp is the -ldflags value that sets the version and the commit, as
// make passes it.
func Stamp(version, commit string) string {
	const pkg = "github.com/kcp-dev/tunnel-broker/internal/version"
	return fmt.Sprintf("-X %s.version=%s -X %s.commit=%s", pkg, version, pkg, commit)
}

// Collector is the <namespace>_build_info gauge: always 1, with the
// version, commit and Go version as labels, so that a dashboard can tell
// which build each replica and agent runs.
func Collector(namespace string) prometheus.Collector {
	i := Get()
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: namespace, Name: "build_info",
		Help:        "Always 1; the labels tell which build this is.",
		ConstLabels: prometheus.Labels{"version": i.Version, "commit": i.Commit, "go_version": i.GoVersion},
	})
	g.Set(1)
	return g
}

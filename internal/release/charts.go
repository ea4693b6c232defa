package release

import (
	"path/filepath"
	"regexp"
	"strings"
)

var (
	chartVersion    = regexp.MustCompile(`(?m)^version:.*$`)
	chartAppVersion = regexp.MustCompile(`(?m)^appVersion:.*$`)
)

// StampCharts sets the version of every chart of deploy/charts to version
// (without its v: a chart's version is SemVer) and its appVersion, which is
// the default image tag, to version, so that a release's charts deploy the
// images make images built for it. It edits lines, keeping comments.
func StampCharts(repo, version string) error {
	return stampFiles(filepath.Join(repo, "deploy", "charts", "*", "Chart.yaml"), func(chart string) string {
		return StampChart(chart, version)
	})
}

// StampChart rewrites a Chart.yaml's version and appVersion lines.
func StampChart(chart, version string) string {
	chart = chartVersion.ReplaceAllLiteralString(chart, "version: "+strings.TrimPrefix(version, "v"))
	return chartAppVersion.ReplaceAllLiteralString(chart, `appVersion: "`+version+`"`)
}

package release

import (
	"path/filepath"
	"regexp"
	"strings"
)

var (
	chartVersion    = regexp.MustCompile(`(?m)^version:.*$`)
	chartAppVersion = regexp.MustCompile(`(?m)^appVersion:.*$`)
	kcpImageTag     = regexp.MustCompile(`(?m)^(  tag:[ \t]*)\S*$`)
)

// KcpChartValues are deploy/kcp's values for kcp-dev's kcp chart: their
// kcp.tag is the tag of the image Kcp that make images builds.
const KcpChartValues = "deploy/kcp/values-kcp-chart.yaml"

// StampKcpChartValues sets kcp.tag in KcpChartValues to version, so that a
// release's values run the kcp image built for it.
func StampKcpChartValues(repo, version string) error {
	return stampFiles(filepath.Join(repo, KcpChartValues), func(values string) string {
		return StampKcpImageTag(values, version)
	})
}

// StampKcpImageTag rewrites the tag line of the kcp: map (indented by two
// spaces) of a values file, keeping comments.
func StampKcpImageTag(values, version string) string {
	return kcpImageTag.ReplaceAllString(values, "${1}"+version)
}

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

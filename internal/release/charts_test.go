package release

import "testing"

func TestStampChartSetsVersionAndAppVersion(t *testing.T) {
	in := "apiVersion: v2\nname: x\n# the chart's\nversion: 0.1.0-dev\nappVersion: \"v0.1.0-dev\"\nkeywords:\n  - version: no\n"
	want := "apiVersion: v2\nname: x\n# the chart's\nversion: 0.2.0\nappVersion: \"v0.2.0\"\nkeywords:\n  - version: no\n"
	if got := StampChart(in, "v0.2.0"); got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

func TestStampKcpImageTagSetsOnlyTheTag(t *testing.T) {
	in := "kcp:\n  # the tag: of ours\n  image: r/kcp-dev/tunnel-kcp\n  tag: v0.1.0-dev\n  extraFlags:\n  - --tag=x\n    tag: nested\n"
	want := "kcp:\n  # the tag: of ours\n  image: r/kcp-dev/tunnel-kcp\n  tag: v0.2.0\n  extraFlags:\n  - --tag=x\n    tag: nested\n"
	if got := StampKcpImageTag(in, "v0.2.0"); got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

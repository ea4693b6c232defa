package version

import (
	"runtime/debug"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestStampedVersionAndCommitWinOverBuildInfo(t *testing.T) {
	bi := &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.0.0-20261201052100-5570f66c1a2b"},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "ffffffffffffffffffff"}}}
	got := resolve("v0.1.0", "5570f66c1a2b", bi)
	want := Info{Version: "v0.1.0", Commit: "5570f66c1a2b", GoVersion: "go1.26.8"}
	if got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
}

func TestAPlainGoBuildInACheckoutReportsWhatTheToolchainRecorded(t *testing.T) {
	bi := &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.1.1-0.20261201052100-5570f66c1a2b+dirty"},
		Settings: []debug.BuildSetting{
			{Key: "vcs.revision", Value: "5570f66c1a2b3c4d5e6f"},
			{Key: "vcs.modified", Value: "true"},
		}}
	got := resolve("", "", bi)
	want := Info{Version: "v0.1.1-0.20261201052100-5570f66c1a2b+dirty", Commit: "5570f66c1a2b-dirty", GoVersion: "go1.26.8"}
	if got != want {
		t.Fatalf("got %+v, want %+v", got, want)
	}
}

func TestABuildWithNothingRecordedSaysUnknown(t *testing.T) {
	// A workspace build with -buildvcs=false: main module "(devel)", no vcs settings.
	got := resolve("", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}})
	if got.Version != Unknown || got.Commit != Unknown || got.GoVersion != "go1.26.8" {
		t.Fatalf("got %+v, want unknown version and commit", got)
	}
	if got := resolve("", "", nil); got.Version != Unknown || !strings.HasPrefix(got.GoVersion, "go") {
		t.Fatalf("without build info: got %+v", got)
	}
}

func TestBuildInfoMetricCarriesTheBuild(t *testing.T) {
	r := prometheus.NewRegistry()
	r.MustRegister(Collector("kcp_tunnel_test"))
	i := Get()
	want := `
# HELP kcp_tunnel_test_build_info Always 1; the labels tell which build this is.
# TYPE kcp_tunnel_test_build_info gauge
kcp_tunnel_test_build_info{commit="` + i.Commit + `",go_version="` + i.GoVersion + `",version="` + i.Version + `"} 1
`
	if err := testutil.GatherAndCompare(r, strings.NewReader(want), "kcp_tunnel_test_build_info"); err != nil {
		t.Fatal(err)
	}
}

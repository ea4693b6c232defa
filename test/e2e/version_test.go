package e2e

import (
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// versionLine is what --version prints: the binary's name, the version,
// the commit and the Go release.
var versionLine = regexp.MustCompile(`^(\S+) (\S+) \(commit (\S+), (go\S+)\)\n$`)

// binaryVersion runs name --version and returns its version, commit and Go
// release.
func binaryVersion(t *testing.T, name string) (ver, commit, goVersion string) {
	t.Helper()
	out, err := exec.Command(filepath.Join(harness.Binaries(t), name), "--version").Output()
	if err != nil {
		t.Fatalf("%s --version: %v", name, err)
	}
	m := versionLine.FindStringSubmatch(string(out))
	if m == nil || m[1] != name {
		t.Fatalf("%s --version printed %q, want %q", name, out, name+" VERSION (commit COMMIT, goX.Y.Z)")
	}
	return m[2], m[3], m[4]
}

func TestEveryBinaryPrintsTheStampedVersion(t *testing.T) {
	for _, name := range []string{"broker", "syncer-agent", "tunnelctl"} {
		ver, commit, _ := binaryVersion(t, name)
		// make and the harness both stamp the VERSION file.
		if want := harness.Version(t); ver != want {
			t.Errorf("%s --version: version %s, want the VERSION file's %s", name, ver, want)
		}
		if commit == "" {
			t.Errorf("%s --version: no commit", name)
		}
	}
}

func TestBrokerAndAgentExportTheirBuildInfo(t *testing.T) {
	env := harness.NewEnv(t)
	broker, addr := env.StartBrokerProcess()
	agent := env.StartAgentProcess(addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": harness.StartEcho(t)}},
	}})
	for _, c := range []struct {
		binary string
		p      *harness.Process
		metric string
	}{{"broker", broker, "kcp_tunnel_broker_build_info"}, {"syncer-agent", agent, "kcp_tunnel_agent_build_info"}} {
		ver, commit, goVersion := binaryVersion(t, c.binary)
		series := c.metric + `{commit="` + commit + `",go_version="` + goVersion + `",version="` + ver + `"} 1`
		resp, err := http.Get("http://" + c.p.MetricsAddr(t) + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + `$`).Match(body) {
			t.Errorf("%s /metrics has no %s", c.binary, series)
		}
	}
}

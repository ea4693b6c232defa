package release

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"golang.org/x/mod/modfile"

	"github.com/kcp-dev/tunnel-broker/internal/release"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// version is what the check serves the modules at: $RELEASE_VERSION (make
// release sets it), else the VERSION file.
func version(t *testing.T) string {
	if v := os.Getenv("RELEASE_VERSION"); v != "" {
		return v
	}
	return harness.Version(t)
}

// review denies ConfigMaps that ask for it.
func review(req *admissionv1.AdmissionRequest, _ string) *admissionv1.AdmissionResponse {
	if strings.Contains(string(req.Object.Raw), `"deny":"yes"`) {
		return &admissionv1.AdmissionResponse{Allowed: false, Result: &metav1.Status{Message: "denied through the tunnel", Code: 403}}
	}
	return &admissionv1.AdmissionResponse{Allowed: true}
}

// The Kubernetes libraries, gRPC, protobuf and Go whose versions a consumer
// chose (those its go.mod names), which adding kcpplugin must not raise.
var pinned = []string{"k8s.io/api", "k8s.io/apimachinery", "k8s.io/apiserver", "k8s.io/client-go",
	"google.golang.org/grpc", "google.golang.org/protobuf", "go"}

func TestReleaseConsumerGetsKcppluginAndCallsAWebhookThroughTheTunnel(t *testing.T) {
	ver := version(t)
	proxy := t.TempDir()
	if err := release.WriteProxy(harness.RepoRoot(), proxy, ver); err != nil {
		t.Fatal(err)
	}

	// The tunnel, as built binaries: a broker, an agent for logical cluster
	// root, and a TLS webhook behind Service default/webhook.
	env := harness.NewEnv(t)
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	brokerProcess, broker := env.StartBrokerProcess()
	env.StartAgentProcess(broker, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: "root", Namespace: "default", Name: "webhook", Ports: map[string]string{"443": wh.Addr},
	}}})
	kcp := env.SVID("/kcp")
	webhookCA := filepath.Join(t.TempDir(), "webhook-ca.crt")
	if err := os.WriteFile(webhookCA, wh.CABundle, 0o600); err != nil {
		t.Fatal(err)
	}
	tunnelEnv := []string{"TUNNEL_BROKER=" + broker, "TUNNEL_SVID_CERT=" + kcp.Cert, "TUNNEL_SVID_KEY=" + kcp.Key,
		"TUNNEL_TRUST_BUNDLE=" + kcp.Bundle, "TUNNEL_WEBHOOK_CA=" + webhookCA}

	// Before a release, as kcpplugin/README.md says: the README's block, as
	// it is, in a module beside a checkout of this repository, with no
	// module proxy serving this repository's modules.
	t.Run("before a release", func(t *testing.T) {
		dir := consumer(t, "oldest")
		if err := os.Symlink(harness.RepoRoot(), filepath.Join(filepath.Dir(dir), "tunnel-broker")); err != nil {
			t.Fatal(err)
		}
		goEnv := goEnv(t, t.TempDir())
		before := requirements(t, dir)
		run(t, dir, goEnv, "bash", "-euc", readmeBlock(t, "## Before a release is tagged"))
		after := requirements(t, dir)
		for _, p := range pinned {
			if v, ok := before[p]; ok && after[p] != v {
				t.Errorf("the pre-release block moved %s from %s to %s", p, before[p], after[p])
			}
		}
		callsThroughTheTunnel(t, dir, append(goEnv, tunnelEnv...), brokerProcess)
	})

	for _, line := range []string{"oldest", "newest"} {
		t.Run(line, func(t *testing.T) {
			dir := consumer(t, line)
			goEnv := goEnv(t, proxy)
			before := requirements(t, dir)

			run(t, dir, goEnv, "go", "get", release.Root+"/kcpplugin@"+ver)
			after := requirements(t, dir)
			if got := after[release.Root+"/kcpplugin"]; got != ver {
				t.Fatalf("go.mod requires kcpplugin %q after go get, want %s", got, ver)
			}
			for _, p := range pinned {
				if v, ok := before[p]; ok && after[p] != v {
					t.Errorf("go get kcpplugin@%s moved %s from %s to %s: kcpplugin's floor is above what it claims", ver, p, before[p], after[p])
				}
			}
			callsThroughTheTunnel(t, dir, append(goEnv, tunnelEnv...), brokerProcess)
			if testing.Verbose() {
				goMod, _ := os.ReadFile(filepath.Join(dir, "go.mod"))
				t.Logf("the consumer's go.mod:\n%s", goMod)
			}
		})
	}
}

// callsThroughTheTunnel runs the consumer's test, which calls a webhook
// through the tunnel, and checks that its calls opened tunnels.
func callsThroughTheTunnel(t *testing.T, dir string, env []string, broker *harness.Process) {
	t.Helper()
	const dialed = `kcp_tunnel_broker_dials_total{code="OK"}`
	tunnels, _ := harness.Scrape(t, broker, dialed)
	run(t, dir, env, "go", "test", "-count=1", "-v", "./...")
	if now, _ := harness.Scrape(t, broker, dialed); now <= tunnels {
		t.Errorf("the consumer's webhook calls opened %v tunnels through the broker, want at least one", now-tunnels)
	}
}

// readmeBlock is the shell block of kcpplugin/README.md's section heading.
func readmeBlock(t *testing.T, heading string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(harness.RepoRoot(), "kcpplugin", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	blocks := harness.ShellBlocks(t, string(data), heading)
	if len(blocks) != 1 {
		t.Fatalf("kcpplugin/README.md's %q section has %d sh blocks, want 1", heading, len(blocks))
	}
	return blocks[0]
}

// consumer copies the consumer module (testdata/consumer, with the go.mod
// and go.sum of line) into a folder outside the repository.
func consumer(t *testing.T, line string) string {
	t.Helper()
	dir := t.TempDir()
	for _, src := range []string{"testdata/consumer/webhook.go", "testdata/consumer/webhook_test.go",
		"testdata/" + line + "/go.mod", "testdata/" + line + "/go.sum"} {
		data, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, filepath.Base(src)), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// goEnv is the environment of the consumer's go commands: a module of its
// own (no workspace), this repository's modules from the local proxy and
// everything else from the usual module proxy, and nothing from anywhere
// else. The module cache is the test's own, so that no other checkout's
// build of the same version is taken from it; modules already in the
// machine's cache are read from there as from a proxy.
func goEnv(t *testing.T, proxy string) []string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOPROXY", "GOMODCACHE").Output()
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	proxies := []string{"file://" + proxy, "file://" + filepath.Join(lines[1], "cache", "download")}
	for _, p := range strings.FieldsFunc(lines[0], func(r rune) bool { return r == ',' || r == '|' }) {
		if p != "direct" && p != "off" {
			proxies = append(proxies, p)
		}
	}
	var env []string
	for _, kv := range os.Environ() {
		switch strings.SplitN(kv, "=", 2)[0] {
		case "GOWORK", "GOFLAGS", "GOPROXY", "GONOPROXY", "GOPRIVATE", "GONOSUMDB", "GOMODCACHE", "GOTOOLCHAIN":
			continue
		}
		env = append(env, kv)
	}
	return append(env,
		"GOWORK=off",
		"GOTOOLCHAIN=local",
		"GOPROXY="+strings.Join(proxies, ","),
		// Not in the checksum database until the repository is public and
		// tagged; from then on consumers need no setting at all.
		"GONOSUMDB="+release.Root,
		"GOMODCACHE="+filepath.Join(t.TempDir(), "modcache"),
		// -modcacherw lets the test remove its module cache; -trimpath
		// keeps compiled packages reusable from the build cache although
		// the module cache moves with every run.
		"GOFLAGS=-mod=mod -modcacherw -trimpath",
	)
}

// requirements is the version of each module dir's go.mod requires, and
// its go directive under "go".
func requirements(t *testing.T, dir string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	f, err := modfile.Parse("go.mod", data, nil)
	if err != nil {
		t.Fatal(err)
	}
	reqs := map[string]string{"go": f.Go.Version}
	for _, r := range f.Require {
		reqs[r.Mod.Path] = r.Mod.Version
	}
	return reqs
}

func run(t *testing.T, dir string, env []string, argv ...string) {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir, cmd.Env = dir, env
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(argv, " "), err, out)
	}
	if testing.Verbose() {
		t.Logf("%s:\n%s", strings.Join(argv, " "), out)
	}
}

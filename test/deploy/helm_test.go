package deploy

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// chartCase is one rendering of a chart of deploy/charts: helm template
// with one of its values files ("" for the defaults) and, if Policy is
// set, the broker's policy from that file (relative to deploy/), as
// release Release in Namespace.
type chartCase struct {
	Chart, Values, Release, Namespace string
	Policy                            string
}

func (c chartCase) String() string {
	if c.Values == "" {
		return c.Chart + "/(defaults)"
	}
	return c.Chart + "/" + c.Values
}

// The releases are named after their charts, so that the objects get the
// names the kustomize bases give them. The broker chart has no default
// policy: with its defaults, it gets deploy/base/broker's.
var chartCases = []chartCase{
	{"tunnel-broker", "", "tunnel-broker", "kcp-system", basePolicy},
	{"tunnel-broker", "ci/production-values.yaml", "tunnel-broker", "kcp-system", ""},
	{"tunnel-broker", "ci/egress-values.yaml", "tunnel-broker", "kcp-system", ""},
	{"tunnel-broker", "dev-values.yaml", "tunnel-broker", "kcp-system", ""},
	{"tunnel-agent", "", "tunnel-agent", "kcp-tunnel", ""},
	{"tunnel-agent", "ci/production-values.yaml", "tunnel-agent", "kcp-tunnel", ""},
	{"tunnel-agent", "dev-values.yaml", "tunnel-agent", "kcp-system", ""},
}

// basePolicy is deploy/base/broker's policy, relative to deploy/.
const basePolicy = "base/broker/policy.yaml"

var charts = []string{"tunnel-broker", "tunnel-agent"}

func chartDir(chart string) string { return filepath.Join(deployDir(), "charts", chart) }

func casesOf(chart string) []chartCase {
	var out []chartCase
	for _, c := range chartCases {
		if c.Chart == chart {
			out = append(out, c)
		}
	}
	return out
}

// helmBinary is the helm built from test/tools/helm.
func helmBinary(t *testing.T) string {
	t.Helper()
	h, err := harness.HelmBinary()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// helmEnv is an environment in which helm reads and writes only the
// test's own folders, and no kubeconfig but kubeconfig ("" for none).
func helmEnv(t *testing.T, kubeconfig string) []string {
	t.Helper()
	home := t.TempDir()
	if kubeconfig == "" {
		kubeconfig = filepath.Join(home, "no-kubeconfig")
	}
	return append(os.Environ(), "KUBECONFIG="+kubeconfig,
		"HELM_CACHE_HOME="+filepath.Join(home, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(home, "config"),
		"HELM_DATA_HOME="+filepath.Join(home, "data"))
}

// runHelm runs helm offline, returning its stdout and stderr.
func runHelm(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := exec.Command(helmBinary(t), args...)
	cmd.Env = helmEnv(t, "")
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}

func (c chartCase) valuesArgs() []string {
	var args []string
	if c.Values != "" {
		args = append(args, "-f", filepath.Join(chartDir(c.Chart), c.Values))
	}
	if c.Policy != "" {
		args = append(args, "--set-file", "policy="+filepath.Join(deployDir(), c.Policy))
	}
	return args
}

var chartRenderings sync.Map // chartCase -> *rendering

// renderChart returns helm template's output for c and the objects in it.
func renderChart(t *testing.T, c chartCase) ([]byte, []object) {
	t.Helper()
	r, _ := chartRenderings.LoadOrStore(c, &rendering{})
	rr := r.(*rendering)
	rr.once.Do(func() {
		args := append([]string{"template", c.Release, chartDir(c.Chart), "--namespace", c.Namespace}, c.valuesArgs()...)
		out, stderr, err := runHelm(t, args...)
		if err != nil {
			rr.err = fmt.Errorf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr)
			return
		}
		rr.yaml = []byte(out)
		rr.objs, rr.err = parseObjects(rr.yaml)
		if rr.err != nil {
			rr.err = fmt.Errorf("%s: %w", c, rr.err)
		}
	})
	if rr.err != nil {
		t.Fatal(rr.err)
	}
	return rr.yaml, rr.objs
}

// TestDeployHelmLint lints each chart with helm lint --strict, with its
// defaults and with each of its values files; every values file in a
// chart's folder and its ci/ is one of chartCases, so a new one is
// linted, rendered, checked and dry-run too.
func TestDeployHelmLint(t *testing.T) {
	for _, chart := range charts {
		files, err := filepath.Glob(filepath.Join(chartDir(chart), "*values.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		ci, err := filepath.Glob(filepath.Join(chartDir(chart), "ci", "*.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range append(files, ci...) {
			rel, _ := filepath.Rel(chartDir(chart), f)
			if rel == "values.yaml" {
				continue
			}
			if !slices.ContainsFunc(chartCases, func(c chartCase) bool { return c.Chart == chart && c.Values == rel }) {
				t.Errorf("deploy/charts/%s/%s is not in chartCases: nothing tests it", chart, rel)
			}
		}
		for _, c := range casesOf(chart) {
			t.Run(c.String(), func(t *testing.T) {
				args := append([]string{"lint", "--strict", chartDir(c.Chart), "--namespace", c.Namespace}, c.valuesArgs()...)
				out, stderr, err := runHelm(t, args...)
				if err != nil || !strings.Contains(out, "1 chart(s) linted, 0 chart(s) failed") {
					t.Errorf("helm %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
				}
				for _, line := range strings.Split(out, "\n") {
					// helm lint's findings but the icon's, which a chart
					// in a repository has no address for.
					if strings.HasPrefix(line, "[") && !strings.Contains(line, "icon is recommended") {
						t.Errorf("helm lint: %s", line)
					}
				}
			})
		}
	}
}

// TestDeployHelmCatches proves the charts refuse values that would make a
// broken installation, saying which value is wrong.
func TestDeployHelmCatches(t *testing.T) {
	for _, c := range []struct {
		chart string
		set   []string
		says  string
	}{
		{"tunnel-broker", []string{"svid.source=files"}, `svid.source is "files"`},
		{"tunnel-broker", []string{"svid.source=secret"}, "set svid.secret.name"},
		{"tunnel-broker", []string{"antiAffinity=maybe"}, `antiAffinity is "maybe"`},
		{"tunnel-broker", []string{"networkPolicy.metricsFrom=null"}, "networkPolicy.metricsFrom"},
		{"tunnel-broker", []string{"policy=null"}, "policy is required"},
		{"tunnel-broker", nil, "policy is required"},
		{"tunnel-agent", []string{"plainCluster="}, "plainCluster is required"},
		{"tunnel-agent", []string{"broker.dns="}, "broker.dns"},
		{"tunnel-agent", []string{"name=a", "replicas=2"}, "need distinct names"},
		{"tunnel-agent", []string{"svid.source=secret"}, "set svid.secret.name"},
	} {
		name := strings.Join(c.set, ",")
		if name == "" {
			name = "(defaults)"
		}
		t.Run(c.chart+"/"+name, func(t *testing.T) {
			var set []string
			for _, s := range c.set {
				set = append(set, "--set", s)
			}
			if c.chart == "tunnel-broker" && len(c.set) > 0 && !strings.HasPrefix(c.set[0], "policy=") {
				// A policy, so that what is refused is the value set.
				set = append(set, brokerPolicyArgs()...)
			}
			// (helm lint renders in lint mode, in which fail and required
			// only log: helm template, and so helm install, refuse.)
			out, stderr, err := runHelm(t, append([]string{"template", c.chart, chartDir(c.chart)}, set...)...)
			if err == nil {
				t.Errorf("helm template succeeded:\n%s", out)
			}
			if !strings.Contains(stderr, c.says) {
				t.Errorf("helm template does not say %q:\n%s", c.says, stderr)
			}
		})
	}
}

// TestDeployHelmBroker renders the broker chart with each values file and
// checks what TestDeployBroker checks of the kustomizations (replicas,
// anti-affinity, flags, probes, resources, security, identity source,
// policy, Services, PodDisruptionBudget, NetworkPolicy), plus its SPIRE
// registration and, where on, the CONNECT front end.
func TestDeployHelmBroker(t *testing.T) {
	for _, c := range casesOf("tunnel-broker") {
		t.Run(c.String(), func(t *testing.T) {
			_, objs := renderChart(t, c)
			d := theDeployment(t, objs)
			bc := container(d.Spec.Template.Spec, "broker")
			if bc == nil {
				t.Fatal("no broker container")
			}
			checkBroker(t, kustomization{Dir: "charts/" + c.String()}, objs, &d)
			flags := flagsOf(bc.Args)
			if _, files := flags["svid-cert"]; !files {
				id, ok := spiffeIDOf(t, objs, &d)
				if want := "spiffe://" + trustDomain + "/ns/" + d.Namespace + "/sa/" + d.Spec.Template.Spec.ServiceAccountName; !ok || id.String() != want {
					t.Errorf("the broker's ClusterSPIFFEID gives it %v (found: %v), want %s", id, ok, want)
				}
			} else if len(ofKind(objs, "ClusterSPIFFEID")) > 0 {
				t.Error("a ClusterSPIFFEID with SVIDs from a Secret: the pod would hold two")
			}
			checkEgress(t, objs, &d, bc, flags)
		})
	}
}

// checkEgress: with --egress-listen, the container has the port, the
// callers' Service and the NetworkPolicy take it, and the policy has an
// egress rule (without one, every CONNECT is refused).
func checkEgress(t *testing.T, objs []object, d *appsv1.Deployment, c *corev1.Container, flags map[string]string) {
	t.Helper()
	addr := flags["egress-listen"]
	if addr == "" {
		return
	}
	port := listenPort(t, "--egress-listen", addr)
	var cp *corev1.ContainerPort
	for i := range c.Ports {
		if c.Ports[i].ContainerPort == port {
			cp = &c.Ports[i]
		}
	}
	if cp == nil {
		t.Fatalf("no container port %d (--egress-listen)", port)
	}
	served := false
	for _, o := range ofKind(objs, "Service") {
		var s corev1.Service
		o.into(t, &s)
		for _, p := range s.Spec.Ports {
			if s.Spec.ClusterIP != corev1.ClusterIPNone && (p.TargetPort.StrVal == cp.Name || p.TargetPort.IntVal == port) {
				served = true
			}
		}
	}
	if !served {
		t.Errorf("no ClusterIP Service serves the egress port %d", port)
	}
	if !strings.Contains(string(findKind(t, objs, "NetworkPolicy")), `"port":"`+cp.Name+`"`) {
		t.Errorf("no NetworkPolicy rule admits the egress port %s", cp.Name)
	}
	var f policy.File
	if err := yaml.Unmarshal(mountedPolicy(t, objs, d, c, flagsOf(c.Args)["policy"]), &f); err != nil {
		t.Fatal(err)
	}
	if len(f.Egress) == 0 {
		t.Error("the CONNECT front end is on, but the policy has no egress rule: it would refuse every CONNECT")
	}
}

// findKind is the JSON of every object of kind, concatenated.
func findKind(t *testing.T, objs []object, kind string) []byte {
	t.Helper()
	var b []byte
	for _, o := range ofKind(objs, kind) {
		b = append(b, o.JSON...)
	}
	return b
}

// TestDeployHelmAgent renders the agent chart with each values file and
// checks what TestDeployAgentSidecar checks of the sidecar (flags that
// exist, probes, resources, security, identity source, read-only RBAC
// bound to the pod's ServiceAccount), that it runs in plain mode, and that
// its pods are registered with SPIRE when they use the Workload API.
func TestDeployHelmAgent(t *testing.T) {
	for _, c := range casesOf("tunnel-agent") {
		t.Run(c.String(), func(t *testing.T) {
			_, objs := renderChart(t, c)
			d := theDeployment(t, objs)
			pod := d.Spec.Template
			ac := container(pod.Spec, "syncer-agent")
			if ac == nil {
				t.Fatal("no syncer-agent container")
			}
			flags := checkAgentFlags(t, objs, &d, ac)
			if flags["plain-cluster"] == "" {
				t.Error("no --plain-cluster: the chart runs the agent in plain mode")
			}
			if replicasOf(&d) > 1 && flags["name"] != "(from POD_NAME)" {
				t.Errorf("%d replicas all named %q: agents side by side need distinct names", replicasOf(&d), flags["name"])
			}
			checkProbes(t, ac, listenPort(t, "--metrics-listen", flags["metrics-listen"]))
			checkResources(t, ac)
			checkSecurity(t, pod.Spec, ac)
			checkIdentitySource(t, pod.Spec, ac, flags)
			checkAgentRBAC(t, objs, &d)
			if pod.Spec.AutomountServiceAccountToken != nil && !*pod.Spec.AutomountServiceAccountToken {
				t.Error("the agent reads the cluster with its ServiceAccount's token: it must be mounted")
			}
			if _, files := flags["svid-cert"]; !files {
				if id, ok := spiffeIDOf(t, objs, &d); !ok {
					t.Error("no ClusterSPIFFEID selects the agent's pods")
				} else {
					t.Logf("agent SPIFFE ID %s", id)
				}
			}
		})
	}
}

// TestDeployHelmServerSideDryRun applies each chart rendering to the real
// kube-apiserver with a server-side dry run, as TestDeployServerSideDryRun
// does each overlay: accepted with strict field validation and Pod
// Security "restricted", with no warning.
func TestDeployHelmServerSideDryRun(t *testing.T) {
	setUpCluster(t)
	var names []string
	for _, c := range chartCases {
		names = append(names, c.Namespace)
	}
	createNamespaces(t, names...)
	for _, c := range chartCases {
		t.Run(c.String(), func(t *testing.T) {
			stream, objs := renderChart(t, c)
			dryRun(t, c.String(), stream, objs)
		})
	}
}

// theDeployment is the one Deployment a chart renders.
func theDeployment(t *testing.T, objs []object) appsv1.Deployment {
	t.Helper()
	deps := ofKind(objs, "Deployment")
	if len(deps) != 1 {
		t.Fatalf("%d Deployments rendered, want 1", len(deps))
	}
	var d appsv1.Deployment
	deps[0].into(t, &d)
	return d
}

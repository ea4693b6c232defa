package deploy

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

// templateChart renders chart with helm template, as release chart in
// namespace kcp-system, with more helm arguments (--set, -f), and
// returns its objects.
func templateChart(t *testing.T, chart string, args ...string) []object {
	t.Helper()
	args = append([]string{"template", chart, chartDir(chart), "--namespace", "kcp-system"}, args...)
	out, stderr, err := runHelm(t, args...)
	if err != nil {
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr)
	}
	objs, err := parseObjects([]byte(out))
	if err != nil {
		t.Fatalf("helm %s: %v", strings.Join(args, " "), err)
	}
	return objs
}

// TestDeployHelmKubeVersion: both charts declare the Kubernetes versions
// they run on (the broker's preStop sleep action needs 1.30), and helm
// refuses to render them for an older one.
func TestDeployHelmKubeVersion(t *testing.T) {
	const want = ">=1.30.0-0"
	for _, chart := range charts {
		t.Run(chart, func(t *testing.T) {
			raw, err := os.ReadFile(filepath.Join(chartDir(chart), "Chart.yaml"))
			if err != nil {
				t.Fatal(err)
			}
			var c struct{ KubeVersion string }
			if err := yaml.Unmarshal(raw, &c); err != nil {
				t.Fatal(err)
			}
			if c.KubeVersion != want {
				t.Errorf("kubeVersion %q, want %q", c.KubeVersion, want)
			}
			args := append([]string{"template", chart, chartDir(chart), "--kube-version", "1.29.9"}, requiredArgs(chart)...)
			if _, stderr, err := runHelm(t, args...); err == nil || !strings.Contains(stderr, "kubeVersion") {
				t.Errorf("helm template for Kubernetes 1.29 did not refuse it for its kubeVersion: %v\n%s", err, stderr)
			}
			args = append([]string{"template", chart, chartDir(chart), "--kube-version", "1.30.0"}, requiredArgs(chart)...)
			if _, stderr, err := runHelm(t, args...); err != nil {
				t.Errorf("helm template for Kubernetes 1.30: %v\n%s", err, stderr)
			}
		})
	}
}

// brokerPolicyArgs are the helm arguments that give the broker chart a
// policy (deploy/base/broker's).
func brokerPolicyArgs() []string {
	return []string{"--set-file", "policy=" + filepath.Join(deployDir(), basePolicy)}
}

// requiredArgs are the helm arguments chart will not render without: the
// broker's policy (brokerPolicyArgs); none for the agent chart.
func requiredArgs(chart string) []string {
	if chart == "tunnel-broker" {
		return brokerPolicyArgs()
	}
	return nil
}

// renderedPolicy is the policy in the broker's ConfigMap, parsed as YAML.
func renderedPolicy(t *testing.T, objs []object) any {
	t.Helper()
	var found any
	n := 0
	for _, o := range ofKind(objs, "ConfigMap") {
		var cm corev1.ConfigMap
		o.into(t, &cm)
		if text, ok := cm.Data["policy.yaml"]; ok {
			n++
			if err := yaml.Unmarshal([]byte(text), &found); err != nil {
				t.Fatalf("ConfigMap %s: policy.yaml: %v", cm.Name, err)
			}
		}
	}
	if n != 1 {
		t.Fatalf("%d ConfigMaps with a policy.yaml rendered, want 1", n)
	}
	return found
}

// TestDeployHelmBrokerPolicyIsTheUsers: the broker's policy is the one
// the values give, whole, with nothing of an example merged in (helm
// merges a map of the values with the chart's default map, so a default
// policy would leave its sync targets, callers or operators in any
// policy that does not name them all): a user's policy without sync
// targets and operators, and the policy of each values file of the
// chart, render as given.
func TestDeployHelmBrokerPolicyIsTheUsers(t *testing.T) {
	const users = `policy:
  agents:
  - id: spiffe://corp.example/ns/kcp-tunnel/sa/tunnel-agent
    clusters: [root]
  callers:
  - id: spiffe://corp.example/ns/kcp/kcp-server
`
	f := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(f, []byte(users), 0o644); err != nil {
		t.Fatal(err)
	}
	files := map[string]string{"a user's": f}
	for _, c := range casesOf("tunnel-broker") {
		if c.Values != "" {
			files[c.Values] = filepath.Join(chartDir(c.Chart), c.Values)
		}
	}
	for name, file := range files {
		t.Run(name, func(t *testing.T) {
			raw, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			var v struct{ Policy any }
			if err := yaml.Unmarshal(raw, &v); err != nil {
				t.Fatal(err)
			}
			if v.Policy == nil {
				t.Skip("no policy in it")
			}
			got := renderedPolicy(t, templateChart(t, "tunnel-broker", "-f", file))
			for _, d := range differences("policy", plain(t, v.Policy), plain(t, got)) {
				// differences names its sides kustomize and chart: here
				// they are the values and the rendering.
				t.Error(strings.NewReplacer("kustomize ", "values ", "chart ", "rendered ").Replace(d))
			}
		})
	}
}

// TestDeployHelmAgentOneBrokerSource: the agent chart passes one way to
// find the broker replicas: --broker when broker.addresses is set (even
// with broker.dns at its default), else --broker-dns; never both.
func TestDeployHelmAgentOneBrokerSource(t *testing.T) {
	for _, c := range []struct {
		set        []string
		flag, want string
	}{
		{nil, "broker-dns", "tunnel-broker-headless.kcp-system.svc:8443"},
		{[]string{"--set", "broker.addresses={a.example.org:8443,b.example.org:8443}"}, "broker", "a.example.org:8443,b.example.org:8443"},
		{[]string{"--set", "broker.loadBalancer=tunnel.example.org:8443"}, "broker-lb", "tunnel.example.org:8443"},
	} {
		t.Run(c.flag, func(t *testing.T) {
			d := theDeployment(t, templateChart(t, "tunnel-agent", c.set...))
			ac := container(d.Spec.Template.Spec, "syncer-agent")
			if ac == nil {
				t.Fatal("no syncer-agent container")
			}
			flags := flagsOf(ac.Args)
			if got := flags[c.flag]; got != c.want {
				t.Errorf("--%s=%q, want %q", c.flag, got, c.want)
			}
			for _, f := range []string{"broker", "broker-dns", "broker-lb"} {
				if _, ok := flags[f]; ok && f != c.flag {
					t.Errorf("--%s as well as --%s: %v", f, c.flag, ac.Args)
				}
			}
		})
	}
}

// TestDeployHelmMetricsPortAnnotations: the prometheus.io/port annotation
// that tells Prometheus where to scrape is the metrics port of the values,
// on the broker's metrics Service and on the agent's pods, whatever port
// that is.
func TestDeployHelmMetricsPortAnnotations(t *testing.T) {
	for _, port := range []string{"", "9191"} {
		var set []string
		if port != "" {
			set = []string{"--set", "ports.metrics=" + port}
		}
		t.Run("tunnel-broker/"+port, func(t *testing.T) {
			objs := templateChart(t, "tunnel-broker", append(brokerPolicyArgs(), set...)...)
			d := theDeployment(t, objs)
			bc := container(d.Spec.Template.Spec, "broker")
			if bc == nil {
				t.Fatal("no broker container")
			}
			want := strconv.Itoa(int(listenPort(t, "--metrics-listen", flagsOf(bc.Args)["metrics-listen"])))
			if port != "" && want != port {
				t.Fatalf("--metrics-listen port %s, want %s (ports.metrics)", want, port)
			}
			found := false
			for _, o := range ofKind(objs, "Service") {
				var s corev1.Service
				o.into(t, &s)
				if len(s.Spec.Ports) == 0 || s.Spec.Ports[0].Name != "metrics" {
					continue
				}
				found = true
				if got := s.Annotations["prometheus.io/port"]; got != want {
					t.Errorf("Service %s: prometheus.io/port %q, want %s (ports.metrics)", s.Name, got, want)
				}
				if got := strconv.Itoa(int(s.Spec.Ports[0].Port)); got != want {
					t.Errorf("Service %s: port %s, want %s", s.Name, got, want)
				}
			}
			if !found {
				t.Error("no metrics Service")
			}
		})
		t.Run("tunnel-agent/"+port, func(t *testing.T) {
			d := theDeployment(t, templateChart(t, "tunnel-agent", set...))
			ac := container(d.Spec.Template.Spec, "syncer-agent")
			if ac == nil {
				t.Fatal("no syncer-agent container")
			}
			want := strconv.Itoa(int(listenPort(t, "--metrics-listen", flagsOf(ac.Args)["metrics-listen"])))
			if port != "" && want != port {
				t.Fatalf("--metrics-listen port %s, want %s (ports.metrics)", want, port)
			}
			a := d.Spec.Template.Annotations
			if a["prometheus.io/scrape"] != "true" || a["prometheus.io/path"] != "/metrics" {
				t.Errorf("the agent's pods have no prometheus.io/scrape and /path annotations: %v", a)
			}
			if got := a["prometheus.io/port"]; got != want {
				t.Errorf("the agent's pods: prometheus.io/port %q, want %s (ports.metrics)", got, want)
			}
		})
	}
}

// TestDeployHelmExtraVolumesAndEnv: extraVolumes, extraVolumeMounts and
// extraEnv of both charts reach the pod (e.g. a policy too large for a
// ConfigMap, or --federated-bundle's file, from a Secret), beside the
// chart's own, and the rendering passes the chart's checks.
func TestDeployHelmExtraVolumesAndEnv(t *testing.T) {
	const values = `extraVolumes:
- name: bundles
  secret:
    secretName: federated-bundles
extraVolumeMounts:
- name: bundles
  mountPath: /etc/bundles
  readOnly: true
extraEnv:
- name: EXTRA
  value: "1"
`
	f := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(f, []byte(values), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ chart, container string }{
		{"tunnel-broker", "broker"},
		{"tunnel-agent", "syncer-agent"},
	} {
		t.Run(c.chart, func(t *testing.T) {
			args := append([]string{"-f", f}, requiredArgs(c.chart)...)
			d := theDeployment(t, templateChart(t, c.chart, args...))
			own := theDeployment(t, templateChart(t, c.chart, args[2:]...)).Spec.Template.Spec
			pod := d.Spec.Template.Spec
			ct := container(pod, c.container)
			if ct == nil {
				t.Fatalf("no %s container", c.container)
			}
			if !slices.ContainsFunc(ct.Env, func(e corev1.EnvVar) bool { return e.Name == "EXTRA" && e.Value == "1" }) {
				t.Errorf("extraEnv is not in the container's env: %v", ct.Env)
			}
			if !slices.ContainsFunc(ct.Env, func(e corev1.EnvVar) bool { return e.Name == "GOMEMLIMIT" }) {
				t.Errorf("the chart's own env is gone: %v", ct.Env)
			}
			if !slices.ContainsFunc(ct.VolumeMounts, func(m corev1.VolumeMount) bool {
				return m.Name == "bundles" && m.MountPath == "/etc/bundles" && m.ReadOnly
			}) {
				t.Errorf("extraVolumeMounts are not the container's: %v", ct.VolumeMounts)
			}
			if !slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool {
				return v.Name == "bundles" && v.Secret != nil && v.Secret.SecretName == "federated-bundles"
			}) {
				t.Errorf("extraVolumes are not the pod's: %v", pod.Volumes)
			}
			if len(pod.Volumes) != len(own.Volumes)+1 || len(ct.VolumeMounts) != len(container(own, c.container).VolumeMounts)+1 {
				t.Errorf("the chart's own volumes are not all there: %v, %v", pod.Volumes, ct.VolumeMounts)
			}
		})
	}
}

// TestDeployHelmAgentPodDisruptionBudget: the agent chart renders a
// PodDisruptionBudget only when asked (podDisruptionBudget.enabled, off by
// default, on in ci/production-values.yaml's two agents), and it selects
// the agent's pods.
func TestDeployHelmAgentPodDisruptionBudget(t *testing.T) {
	if pdbs := ofKind(templateChart(t, "tunnel-agent"), "PodDisruptionBudget"); len(pdbs) != 0 {
		t.Errorf("the defaults render %d PodDisruptionBudgets, want none", len(pdbs))
	}
	for name, args := range map[string][]string{
		"enabled":                   {"--set", "podDisruptionBudget.enabled=true", "--set", "replicas=2"},
		"ci/production-values.yaml": {"-f", filepath.Join(chartDir("tunnel-agent"), "ci", "production-values.yaml")},
	} {
		t.Run(name, func(t *testing.T) {
			objs := templateChart(t, "tunnel-agent", args...)
			d := theDeployment(t, objs)
			pdbs := ofKind(objs, "PodDisruptionBudget")
			if len(pdbs) != 1 {
				t.Fatalf("%d PodDisruptionBudgets rendered, want 1", len(pdbs))
			}
			var pdb policyv1.PodDisruptionBudget
			pdbs[0].into(t, &pdb)
			if pdb.Spec.MaxUnavailable == nil || pdb.Spec.MaxUnavailable.IntValue() != 1 {
				t.Errorf("maxUnavailable %v, want 1", pdb.Spec.MaxUnavailable)
			}
			sel, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector)
			if err != nil || sel.Empty() || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
				t.Errorf("the PodDisruptionBudget's selector %v does not select the agent's pods (%v): %v", pdb.Spec.Selector, d.Spec.Template.Labels, err)
			}
		})
	}
}

// TestDeployHelmBrokerDevPolicyIsDevCAs: the broker chart's
// dev-values.yaml carries the policy tunnelctl dev-ca writes, as its
// comment says, and nothing else.
func TestDeployHelmBrokerDevPolicyIsDevCAs(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "dev")
	if out, err := exec.Command(filepath.Join(os.Getenv("TUNNEL_BIN_DIR"), "tunnelctl"), "dev-ca", dir).CombinedOutput(); err != nil {
		t.Fatalf("tunnelctl dev-ca: %v\n%s", err, out)
	}
	raw, err := os.ReadFile(filepath.Join(dir, "policy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var devca any
	if err := yaml.Unmarshal(raw, &devca); err != nil {
		t.Fatal(err)
	}
	raw, err = os.ReadFile(filepath.Join(chartDir("tunnel-broker"), "dev-values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var v struct{ Policy any }
	if err := yaml.Unmarshal(raw, &v); err != nil {
		t.Fatal(err)
	}
	for _, d := range differences("policy", plain(t, devca), plain(t, v.Policy)) {
		t.Error(strings.NewReplacer("kustomize ", "dev-ca ", "chart ", "dev-values.yaml ").Replace(d))
	}
}

// TestDeployHelmClusterSPIFFEIDClassName: both charts' ClusterSPIFFEIDs
// carry the class of the controller manager SPIRE's Helm charts install
// (a controller manager with a class skips every other ClusterSPIFFEID
// silently), and none for a className of "".
func TestDeployHelmClusterSPIFFEIDClassName(t *testing.T) {
	for _, chart := range []string{"tunnel-broker", "tunnel-agent"} {
		base := requiredArgs(chart)
		for _, c := range []struct {
			set  []string
			want string
		}{
			{nil, "spire-server-spire"},
			{[]string{"--set", "clusterSPIFFEID.className=other-class"}, "other-class"},
			{[]string{"--set", "clusterSPIFFEID.className="}, ""},
		} {
			objs := templateChart(t, chart, append(base, c.set...)...)
			ids := ofKind(objs, "ClusterSPIFFEID")
			if len(ids) != 1 {
				t.Fatalf("%s %v: %d ClusterSPIFFEIDs, want 1", chart, c.set, len(ids))
			}
			var id struct {
				Spec map[string]any `json:"spec"`
			}
			if err := json.Unmarshal(ids[0].JSON, &id); err != nil {
				t.Fatal(err)
			}
			got, has := id.Spec["className"]
			if c.want == "" && has || c.want != "" && got != c.want {
				t.Errorf("%s %v: className %v (set: %v), want %q", chart, c.set, got, has, c.want)
			}
		}
	}
}

// TestDeployHelmShutdownDurationsAgree: a pod's
// terminationGracePeriodSeconds must cover the broker's preStop sleep and
// the tunnels' --grace, or the kubelet kills tunnels --grace lets run:
// each chart refuses to render values that disagree, and says which.
func TestDeployHelmShutdownDurationsAgree(t *testing.T) {
	for _, c := range []struct {
		chart string
		set   []string
		want  string // "": renders
	}{
		{"tunnel-broker", nil, ""},
		{"tunnel-broker", []string{"--set", "grace=2m", "--set", "terminationGracePeriodSeconds=130"}, ""},
		{"tunnel-broker", []string{"--set", "grace=30s"}, "terminationGracePeriodSeconds is 35: it must be at least 40, the preStop sleep (preStopSleepSeconds, 5 s) plus grace (30 s) plus 5 s"},
		{"tunnel-broker", []string{"--set", "grace=1h30m"}, `grace is "1h30m": whole seconds or minutes, like 20s or 2m`},
		{"tunnel-agent", nil, ""},
		{"tunnel-agent", []string{"--set", "terminationGracePeriodSeconds=20"}, "terminationGracePeriodSeconds is 20: it must be at least 25, grace (20 s) plus 5 s"},
	} {
		args := append([]string{"template", c.chart, chartDir(c.chart), "--namespace", "kcp-system"}, requiredArgs(c.chart)...)
		_, stderr, err := runHelm(t, append(args, c.set...)...)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s %v: %v\n%s", c.chart, c.set, err, stderr)
		case c.want != "" && (err == nil || !strings.Contains(stderr, c.want)):
			t.Errorf("%s %v: rendered (%v), want a refusal saying %q; stderr:\n%s", c.chart, c.set, err, c.want, stderr)
		}
	}
}

// TestDeployHelmNotesNameWhatTheChartMade: what each chart tells after an
// install names the Deployment, Services and policy it rendered.
func TestDeployHelmNotesNameWhatTheChartMade(t *testing.T) {
	for _, c := range []struct {
		chart string
		args  []string
		want  []string
	}{
		{"tunnel-broker", brokerPolicyArgs(), []string{
			"rollout status deploy/tunnel-broker", "tunnel-broker.kcp-system.svc:8443",
			"tunnel-broker-headless.kcp-system.svc:8443", "ConfigMap tunnel-broker-policy",
			"className spire-server-spire"}},
		{"tunnel-agent", nil, []string{
			"rollout status deploy/tunnel-agent", "tunnel-broker-headless.kcp-system.svc:8443", "logical cluster root"}},
	} {
		args := append([]string{"install", c.chart, chartDir(c.chart), "--dry-run=client", "--namespace", "kcp-system"}, c.args...)
		out, stderr, err := runHelm(t, args...)
		if err != nil {
			t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr)
		}
		_, notes, ok := strings.Cut(out, "NOTES:\n")
		if !ok {
			t.Fatalf("%s: no NOTES", c.chart)
		}
		objs := templateChart(t, c.chart, c.args...)
		for _, w := range c.want {
			if !strings.Contains(notes, w) {
				t.Errorf("%s's notes do not say %q:\n%s", c.chart, w, notes)
			}
		}
		for _, kind := range []string{"Deployment", "Service"} {
			for _, o := range ofKind(objs, kind) {
				if kind == "Service" && strings.HasSuffix(o.Name, "-metrics") {
					continue
				}
				if !strings.Contains(notes, o.Name) {
					t.Errorf("%s's notes do not name its %s %s", c.chart, kind, o.Name)
				}
			}
		}
	}
}

// TestDeployHelmPodMonitorScrapesThePodsMetricsPort: with podMonitor on,
// each chart's PodMonitor selects its own pods and scrapes the container
// port that serves /metrics.
func TestDeployHelmPodMonitorScrapesThePodsMetricsPort(t *testing.T) {
	for _, chart := range []string{"tunnel-broker", "tunnel-agent"} {
		args := requiredArgs(chart)
		if n := len(ofKind(templateChart(t, chart, args...), "PodMonitor")); n != 0 {
			t.Errorf("%s: %d PodMonitors by default, want none", chart, n)
		}
		objs := templateChart(t, chart, append(args, "--set", "podMonitor.enabled=true", "--set", "podMonitor.labels.release=prometheus")...)
		pms := ofKind(objs, "PodMonitor")
		if len(pms) != 1 {
			t.Fatalf("%s: %d PodMonitors, want 1", chart, len(pms))
		}
		var pm struct {
			Metadata metav1.ObjectMeta `json:"metadata"`
			Spec     struct {
				Selector  metav1.LabelSelector `json:"selector"`
				Endpoints []struct {
					Port string `json:"port"`
					Path string `json:"path"`
				} `json:"podMetricsEndpoints"`
			} `json:"spec"`
		}
		if err := json.Unmarshal(pms[0].JSON, &pm); err != nil {
			t.Fatal(err)
		}
		if pm.Metadata.Labels["release"] != "prometheus" {
			t.Errorf("%s: the PodMonitor's labels %v lack podMonitor.labels", chart, pm.Metadata.Labels)
		}
		d := theDeployment(t, objs)
		sel, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
		if err != nil || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
			t.Errorf("%s: the PodMonitor's selector %v does not select the pods (%v)", chart, pm.Spec.Selector, d.Spec.Template.Labels)
		}
		// The values' ports.metrics: the broker's 9090, the agent's 9091.
		want := map[string]int32{"tunnel-broker": 9090, "tunnel-agent": 9091}[chart]
		var metricsPort string
		for _, c := range d.Spec.Template.Spec.Containers {
			for _, p := range c.Ports {
				if p.ContainerPort == want {
					metricsPort = p.Name
				}
			}
		}
		if len(pm.Spec.Endpoints) != 1 || pm.Spec.Endpoints[0].Port != metricsPort || pm.Spec.Endpoints[0].Path != "/metrics" {
			t.Errorf("%s: the PodMonitor scrapes %+v, want port %q at /metrics", chart, pm.Spec.Endpoints, metricsPort)
		}
	}
}

// TestDeployHelmLoadBalancerReachesReplicasFromTheirStart: with
// services.loadBalancer, the agents' LoadBalancer Service and the Service
// the brokers count (--replicas-dns) list each replica from its start,
// the others ready ones only (checkBrokerServices); without countReplicas
// there is neither the flag nor the counted Service.
func TestDeployHelmLoadBalancerReachesReplicasFromTheirStart(t *testing.T) {
	for _, set := range [][]string{
		{"--set", "services.loadBalancer.enabled=true"},
		{"--set", "countReplicas=false"},
	} {
		t.Run(strings.Join(set[1:], ","), func(t *testing.T) {
			objs := templateChart(t, "tunnel-broker", append(brokerPolicyArgs(), set...)...)
			d := theDeployment(t, objs)
			bc := container(d.Spec.Template.Spec, "broker")
			if bc == nil {
				t.Fatal("no broker container")
			}
			flags := flagsOf(bc.Args)
			lb, counted := false, false
			for _, o := range ofKind(objs, "Service") {
				var s corev1.Service
				o.into(t, &s)
				lb = lb || s.Spec.Type == corev1.ServiceTypeLoadBalancer
				counted = counted || strings.HasSuffix(s.Name, "-replicas")
			}
			if wantLB := set[1] == "services.loadBalancer.enabled=true"; lb != wantLB {
				t.Errorf("a LoadBalancer Service rendered: %v, want %v", lb, wantLB)
			}
			if wantCounted := set[1] != "countReplicas=false"; counted != wantCounted || (flags["replicas-dns"] != "") != wantCounted {
				t.Errorf("the -replicas Service rendered: %v, --replicas-dns %q; want both only with countReplicas", counted, flags["replicas-dns"])
			}
			checkBrokerServices(t, objs, &d, bc, flags, listenPort(t, "--listen", flags["listen"]), listenPort(t, "--metrics-listen", flags["metrics-listen"]))
		})
	}
}

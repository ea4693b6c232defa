package deploy

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// The broker chart's renderings and the kustomizations that must render
// the same broker: the same objects (but for the ones listed in
// kustomizeOnly), and in each the same spec, once what is bound to differ
// is set aside (essentials).
var brokerDrift = []struct {
	kustomize []string // folders of deploy/, rendered and put together
	chart     chartCase
}{
	{[]string{"base/broker", "base/spire"}, chartCases[0]},
	{[]string{"overlays/production"}, chartCases[1]},
}

// kustomizeOnly are objects the kustomizations render that the broker
// chart leaves to others: kcp's SPIRE registration belongs to kcp's
// installation.
var kustomizeOnly = map[string]bool{"ClusterSPIFFEID/kcp": true}

// TestDeployHelmMatchesKustomize renders the broker chart and the
// kustomize bases and overlays it mirrors, and the agent chart and the
// sidecar Component, and fails on any difference in what they deploy:
// container args, env, ports, probes, lifecycle, resources, security
// contexts, volumes, the pod's and the Deployment's settings, Services,
// the PodDisruptionBudget, NetworkPolicies, the policy, the SPIRE
// registration and the agent's RBAC rules. Labels, selectors, the
// ConfigMap's generated name and the image tag are bound to differ (helm's
// conventions, kustomize's hash; TestDeployOverlaysDeployTheImagesOfThisVersion
// and TestDeployHelmChartsDeployTheImagesOfThisVersion check the tags).
func TestDeployHelmMatchesKustomize(t *testing.T) {
	for _, p := range brokerDrift {
		t.Run(strings.Join(p.kustomize, "+")+"~"+p.chart.String(), func(t *testing.T) {
			var kobjs []object
			for _, dir := range p.kustomize {
				_, objs := render(t, dir)
				kobjs = append(kobjs, objs...)
			}
			_, hobjs := renderChart(t, p.chart)
			for _, d := range driftOf(t, kobjs, hobjs) {
				t.Error(d)
			}
		})
	}
	t.Run("agent/sidecar~tunnel-agent", func(t *testing.T) {
		_, kobjs := render(t, "overlays/syncer-sidecar-example")
		_, hobjs := renderChart(t, chartCases[4])
		for _, d := range agentDriftOf(t, kobjs, hobjs) {
			t.Error(d)
		}
	})
}

// TestDeployHelmDriftCatches proves the comparison has teeth: a changed
// flag, probe, security setting, volume, Service port, NetworkPolicy rule,
// policy or RBAC rule, and a missing object, are each reported.
func TestDeployHelmDriftCatches(t *testing.T) {
	_, kobjs := render(t, "base/broker")
	_, spire := render(t, "base/spire")
	kobjs = append(slices.Clone(kobjs), spire...)
	_, hobjs := renderChart(t, chartCases[0])
	if d := driftOf(t, kobjs, hobjs); len(d) > 0 {
		t.Fatalf("drift before any change: %v", d)
	}
	edit := func(objs []object, kind, name string, change func(m map[string]any)) []object {
		out := slices.Clone(objs)
		for i, o := range out {
			if o.Kind == kind && strings.HasPrefix(o.Name, name) {
				var m map[string]any
				if err := json.Unmarshal(o.JSON, &m); err != nil {
					t.Fatal(err)
				}
				change(m)
				j, err := json.Marshal(m)
				if err != nil {
					t.Fatal(err)
				}
				out[i].JSON = j
				return out
			}
		}
		t.Fatalf("no %s %s", kind, name)
		return nil
	}
	brokerContainer := func(m map[string]any) map[string]any {
		return dig(m, "spec", "template", "spec", "containers").([]any)[0].(map[string]any)
	}
	for _, c := range []struct {
		name  string
		objs  []object
		wants string
	}{
		{"flag", edit(hobjs, "Deployment", "tunnel-broker", func(m map[string]any) {
			c := brokerContainer(m)
			c["args"] = append(c["args"].([]any), "--max-tunnels-per-caller=1")
		}), `kustomize (nothing), chart "--max-tunnels-per-caller=1"`},
		{"probe", edit(hobjs, "Deployment", "tunnel-broker", func(m map[string]any) {
			dig(brokerContainer(m), "readinessProbe", "httpGet").(map[string]any)["path"] = "/healthz"
		}), "readinessProbe.httpGet.path"},
		{"security", edit(hobjs, "Deployment", "tunnel-broker", func(m map[string]any) {
			brokerContainer(m)["securityContext"].(map[string]any)["readOnlyRootFilesystem"] = false
		}), "securityContext.readOnlyRootFilesystem"},
		{"volume", edit(hobjs, "Deployment", "tunnel-broker", func(m map[string]any) {
			v := dig(m, "spec", "template", "spec", "volumes").([]any)
			dig(v[1].(map[string]any), "csi").(map[string]any)["driver"] = "csi.example.org"
		}), "volumes[1].csi.driver"},
		{"service port", edit(hobjs, "Service", "tunnel-broker-headless", func(m map[string]any) {
			dig(m, "spec", "ports").([]any)[0].(map[string]any)["port"] = 9443
		}), "ports[0].port"},
		{"network policy", edit(hobjs, "NetworkPolicy", "tunnel-broker", func(m map[string]any) {
			dig(m, "spec").(map[string]any)["ingress"] = dig(m, "spec", "ingress").([]any)[1:]
		}), "NetworkPolicy/tunnel-broker.ingress[1]: kustomize"},
		{"policy", edit(hobjs, "ConfigMap", "tunnel-broker-policy", func(m map[string]any) {
			dig(m, "data").(map[string]any)["policy.yaml"] = "agents: []\ncallers: []\n"
		}), "policy.yaml"},
		{"missing object", slices.DeleteFunc(slices.Clone(hobjs), func(o object) bool { return o.Kind == "PodDisruptionBudget" }),
			"PodDisruptionBudget/tunnel-broker: rendered by kustomize, not by the chart"},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := driftOf(t, kobjs, c.objs)
			if !slices.ContainsFunc(d, func(s string) bool { return strings.Contains(s, c.wants) }) {
				t.Errorf("no difference at %q reported: %v", c.wants, d)
			}
		})
	}
	t.Run("agent rbac", func(t *testing.T) {
		_, kobjs := render(t, "overlays/syncer-sidecar-example")
		_, hobjs := renderChart(t, chartCases[4])
		hobjs = edit(hobjs, "ClusterRole", "kcp-tunnel-agent", func(m map[string]any) {
			m["rules"].([]any)[0].(map[string]any)["verbs"] = []any{"get", "list", "watch", "update"}
		})
		if d := agentDriftOf(t, kobjs, hobjs); !slices.ContainsFunc(d, func(s string) bool { return strings.Contains(s, "rules[0].verbs[3]") }) {
			t.Errorf("an added verb is not reported: %v", d)
		}
	})
}

// dig follows keys down maps.
func dig(m map[string]any, keys ...string) any {
	var v any = m
	for _, k := range keys {
		v = v.(map[string]any)[k]
	}
	return v
}

// driftOf compares the broker objects of a kustomize rendering and a chart
// rendering, and lists every difference.
func driftOf(t *testing.T, kobjs, hobjs []object) []string {
	t.Helper()
	kess, hess := map[string]any{}, map[string]any{}
	for _, o := range kobjs {
		if k := driftKey(o, true); !kustomizeOnly[k] && o.Kind != "Namespace" {
			kess[k] = essentials(t, o)
		}
	}
	for _, o := range hobjs {
		hess[driftKey(o, false)] = essentials(t, o)
	}
	var diffs []string
	for _, k := range slices.Sorted(maps.Keys(kess)) {
		if _, ok := hess[k]; !ok {
			diffs = append(diffs, k+": rendered by kustomize, not by the chart")
			continue
		}
		diffs = append(diffs, differences(k, kess[k], hess[k])...)
	}
	for _, k := range slices.Sorted(maps.Keys(hess)) {
		if _, ok := kess[k]; !ok {
			diffs = append(diffs, k+": rendered by the chart, not by kustomize")
		}
	}
	return diffs
}

var generatedSuffix = regexp.MustCompile(`-[a-z0-9]{10}$`)

// driftKey is Kind/name, without the hash kustomize's generators append.
func driftKey(o object, kustomize bool) string {
	name := o.Name
	if kustomize && o.Kind == "ConfigMap" {
		name = generatedSuffix.ReplaceAllString(name, "")
	}
	return o.Kind + "/" + name
}

// essentials is what must be the same of an object in both renderings, as
// plain JSON values: its spec (or data) but for labels and selectors
// (helm's and kustomize's conventions differ), the policy's ConfigMap's
// name (kustomize appends a hash), the pods' annotations (helm's policy
// checksum) and the image's tag or digest; the annotations of Services.
func essentials(t *testing.T, o object) any {
	t.Helper()
	var v any
	switch o.Kind {
	case "Deployment":
		var d appsv1.Deployment
		o.into(t, &d)
		v = deploymentEssentials(d)
	case "Service":
		var s corev1.Service
		o.into(t, &s)
		s.Spec.Selector = nil
		v = map[string]any{"annotations": s.Annotations, "spec": s.Spec}
	case "NetworkPolicy":
		var np networkingv1.NetworkPolicy
		o.into(t, &np)
		np.Spec.PodSelector = metav1.LabelSelector{}
		v = np.Spec
	case "PodDisruptionBudget":
		var pdb policyv1.PodDisruptionBudget
		o.into(t, &pdb)
		pdb.Spec.Selector = nil
		v = pdb.Spec
	case "ServiceAccount":
		var sa corev1.ServiceAccount
		o.into(t, &sa)
		v = map[string]any{"automountServiceAccountToken": sa.AutomountServiceAccountToken, "secrets": sa.Secrets}
	case "ConfigMap":
		var cm corev1.ConfigMap
		o.into(t, &cm)
		data := map[string]any{}
		for k, text := range cm.Data {
			var parsed any
			if err := yaml.Unmarshal([]byte(text), &parsed); err != nil {
				t.Fatalf("%s: %s: %v", o, k, err)
			}
			data[k] = parsed
		}
		v = data
	case "ClusterSPIFFEID":
		var c map[string]any
		if err := json.Unmarshal(o.JSON, &c); err != nil {
			t.Fatal(err)
		}
		spec := c["spec"].(map[string]any)
		delete(spec, "podSelector")
		v = spec
	case "ClusterRole":
		var r rbacv1.ClusterRole
		o.into(t, &r)
		v = r.Rules
	default:
		var m map[string]any
		if err := json.Unmarshal(o.JSON, &m); err != nil {
			t.Fatal(err)
		}
		delete(m, "metadata")
		v = m
	}
	return plain(t, v)
}

func deploymentEssentials(d appsv1.Deployment) appsv1.DeploymentSpec {
	spec := *d.Spec.DeepCopy()
	spec.Selector = nil
	spec.Template.ObjectMeta = metav1.ObjectMeta{}
	ps := &spec.Template.Spec
	if a := ps.Affinity; a != nil && a.PodAntiAffinity != nil {
		for i := range a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution {
			a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution[i].LabelSelector = nil
		}
		for i := range a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
			a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution[i].PodAffinityTerm.LabelSelector = nil
		}
	}
	for i := range ps.TopologySpreadConstraints {
		ps.TopologySpreadConstraints[i].LabelSelector = nil
	}
	for i := range ps.Volumes {
		if cm := ps.Volumes[i].ConfigMap; cm != nil {
			cm.Name = "(the policy)"
		}
	}
	for i := range ps.Containers {
		ps.Containers[i].Image = imageRepository(ps.Containers[i].Image)
	}
	return spec
}

// imageRepository is an image reference without its tag or digest.
func imageRepository(image string) string {
	image, _, _ = strings.Cut(image, "@")
	if i := strings.LastIndex(image, ":"); i > strings.LastIndex(image, "/") {
		image = image[:i]
	}
	return image
}

// imageHost splits a full image name into its registry host and the rest.
// As container runtimes read a name, its first part is a host only if it
// is localhost or has a dot or a colon; otherwise ok is false, and the
// runtime would prefix the name with its default registry's host.
func imageHost(image string) (host, rest string, ok bool) {
	host, rest, ok = strings.Cut(image, "/")
	if !ok || (host != "localhost" && !strings.ContainsAny(host, ".:")) {
		return "", image, false
	}
	return host, rest, true
}

// plain turns v into plain JSON values (maps, lists, strings, numbers),
// with the API types' own omissions of empty fields.
func plain(t *testing.T, v any) any {
	t.Helper()
	j, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	if err := json.Unmarshal(j, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// differences lists, by path, where the plain JSON values k (kustomize's)
// and h (the chart's) differ.
func differences(path string, k, h any) []string {
	km, kok := k.(map[string]any)
	hm, hok := h.(map[string]any)
	if kok && hok {
		var out []string
		keys := slices.Sorted(maps.Keys(km))
		for key := range hm {
			if _, ok := km[key]; !ok {
				keys = append(keys, key)
			}
		}
		for _, key := range keys {
			out = append(out, differences(path+"."+key, km[key], hm[key])...)
		}
		return out
	}
	kl, kok := k.([]any)
	hl, hok := h.([]any)
	if kok && hok {
		var out []string
		for i := range max(len(kl), len(hl)) {
			var ki, hi any
			if i < len(kl) {
				ki = kl[i]
			}
			if i < len(hl) {
				hi = hl[i]
			}
			out = append(out, differences(fmt.Sprintf("%s[%d]", path, i), ki, hi)...)
		}
		return out
	}
	if reflect.DeepEqual(k, h) {
		return nil
	}
	show := func(v any) string {
		if v == nil {
			return "(nothing)"
		}
		j, _ := json.Marshal(v)
		return string(j)
	}
	return []string{fmt.Sprintf("%s: kustomize %s, chart %s", path, show(k), show(h))}
}

// agentDriftOf compares the sidecar that deploy/agent adds to a syncer
// with the agent chart's container, and their RBAC. The two run in
// different modes (sync target, plain) with their settings from different
// places (a ConfigMap, values), so of the args only the flags both take
// from the manifests (the metrics address, the grace) are compared, and of
// the env the variables not read from the sidecar's ConfigMap; everything
// else of the container must be the same (the image but for its registry),
// and so must the Workload API's volume and the ClusterRole's rules.
func agentDriftOf(t *testing.T, kobjs, hobjs []object) []string {
	t.Helper()
	agent := func(objs []object) (*corev1.Container, []corev1.Volume, []rbacv1.PolicyRule) {
		var c *corev1.Container
		var vols []corev1.Volume
		for _, o := range ofKind(objs, "Deployment") {
			var d appsv1.Deployment
			o.into(t, &d)
			if ac := container(d.Spec.Template.Spec, "syncer-agent"); ac != nil {
				c = ac
				for _, v := range d.Spec.Template.Spec.Volumes {
					if v.CSI != nil {
						vols = append(vols, v)
					}
				}
			}
		}
		if c == nil {
			t.Fatal("no syncer-agent container rendered")
		}
		roles := ofKind(objs, "ClusterRole")
		if len(roles) != 1 {
			t.Fatalf("%d ClusterRoles rendered, want the agent's", len(roles))
		}
		var r rbacv1.ClusterRole
		roles[0].into(t, &r)
		return c, vols, r.Rules
	}
	essentials := func(c *corev1.Container) corev1.Container {
		e := *c.DeepCopy()
		// The example overlay names a registry, the chart's defaults
		// localhost (the images make images builds).
		_, e.Image, _ = imageHost(imageRepository(e.Image))
		flags := flagsOf(e.Args)
		e.Args = nil
		for _, f := range []string{"metrics-listen", "grace"} {
			e.Args = append(e.Args, "--"+f+"="+flags[f])
		}
		e.Env = slices.DeleteFunc(e.Env, func(v corev1.EnvVar) bool {
			return v.ValueFrom != nil && v.ValueFrom.ConfigMapKeyRef != nil
		})
		return e
	}
	kc, kvols, krules := agent(kobjs)
	hc, hvols, hrules := agent(hobjs)
	var diffs []string
	diffs = append(diffs, differences("container", plain(t, essentials(kc)), plain(t, essentials(hc)))...)
	diffs = append(diffs, differences("volumes", plain(t, kvols), plain(t, hvols))...)
	diffs = append(diffs, differences("ClusterRole.rules", plain(t, krules), plain(t, hrules))...)
	return diffs
}

// TestDeployHelmSidecarSnippet: the sidecar that the agent chart's README
// shows for a syncer's Deployment is deploy/agent/sidecar.yaml's: the same
// container, volumes and pod labels.
func TestDeployHelmSidecarSnippet(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(chartDir("tunnel-agent"), "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	const heading = "## As a syncer's sidecar"
	start := strings.Index(string(raw), "\n"+heading+"\n")
	if start < 0 {
		t.Fatalf("the agent chart's README has no %q", heading)
	}
	blocks := regexp.MustCompile("(?s)```yaml\n(.*?)```").FindAllStringSubmatch(string(raw[start:]), -1)
	if len(blocks) != 1 {
		t.Fatalf("%q has %d yaml blocks, want the snippet", heading, len(blocks))
	}
	patch, err := os.ReadFile(filepath.Join(deployDir(), "agent", "sidecar.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	parse := func(what string, y []byte) (any, any, any) {
		j, err := yaml.YAMLToJSON(y)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		var d appsv1.Deployment
		object{Kind: "Deployment", Name: what, JSON: j}.into(t, &d)
		return plain(t, d.Spec.Template.Spec.Containers), plain(t, d.Spec.Template.Spec.Volumes), plain(t, d.Spec.Template.Labels)
	}
	sc, sv, sl := parse("the README's snippet", []byte(blocks[0][1]))
	pc, pv, pl := parse("deploy/agent/sidecar.yaml", patch)
	var diffs []string
	diffs = append(diffs, differences("containers", pc, sc)...)
	diffs = append(diffs, differences("volumes", pv, sv)...)
	diffs = append(diffs, differences("labels", pl, sl)...)
	for _, d := range diffs {
		// differences names its sides kustomize and chart: here they are
		// sidecar.yaml and the README.
		t.Error(strings.NewReplacer("kustomize ", "sidecar.yaml ", "chart ", "README ").Replace(d))
	}
}

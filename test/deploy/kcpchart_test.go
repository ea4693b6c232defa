package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/internal/release"
)

// kcp-dev's kcp Helm chart (chart kcp of kcp-dev/helm-charts), as read at
// chart version 0.12.4 (appVersion 0.28.1; charts/kcp/templates/
// server-deployment.yaml and _helpers.tpl). The chart is not vendored, so
// these tests build the kcp server Deployment it renders with
// deploy/kcp/values-kcp-chart.yaml from what it does with those values:
//   - the pods' labels are the chart's common.labels plus
//     app.kubernetes.io/component (server, etcd, front-proxy);
//   - it sets no serviceAccountName: its pods run as the namespace's
//     ServiceAccount default (the API server's admission fills it in);
//   - the kcp container is image kcp.image:kcp.tag (the tag defaults to
//     v<appVersion>), command [/kcp, start], its own flags and then each of
//     kcp.extraFlags rendered as "- {{ . }}"; kcp.extraVolumeMounts and
//     kcp.extraVolumes are appended to its own.
const (
	kcpChartVersion    = "0.12.4"
	kcpChartAppVersion = "0.28.1"
	kcpServiceAccount  = "default"
	// The namespace deploy/ expects kcp in (the chart's README installs
	// into kcp too).
	kcpNamespace = "kcp"
)

// kcpChartReleases are release names the tests install the chart as: the
// broker's side must not depend on it (the chart's README says my-kcp).
var kcpChartReleases = []string{"kcp", "my-kcp"}

// kcpChartPodLabels are the labels the chart gives the pods of one of its
// components, without nameOverride.
func kcpChartPodLabels(release, component string) map[string]string {
	return map[string]string{
		"app.kubernetes.io/name":       "kcp",
		"app.kubernetes.io/instance":   release,
		"app.kubernetes.io/version":    kcpChartAppVersion,
		"app.kubernetes.io/managed-by": "Helm",
		"helm.sh/chart":                "kcp-" + kcpChartVersion,
		"app.kubernetes.io/component":  component,
	}
}

// kcpChartValues is what deploy/kcp/values-kcp-chart.yaml may set: the
// image, the extra flags, volumes and mounts, nothing else.
type kcpChartValues struct {
	KCP struct {
		Image             string               `json:"image"`
		Tag               string               `json:"tag"`
		ExtraFlags        []string             `json:"extraFlags"`
		ExtraVolumes      []corev1.Volume      `json:"extraVolumes"`
		ExtraVolumeMounts []corev1.VolumeMount `json:"extraVolumeMounts"`
	} `json:"kcp"`
}

const kcpValuesFile = "kcp/values-kcp-chart.yaml" // in deploy/

// loadKcpChartValues reads the values, refusing any key but those.
func loadKcpChartValues(t *testing.T) kcpChartValues {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(deployDir(), kcpValuesFile))
	if err != nil {
		t.Fatal(err)
	}
	j, err := yaml.YAMLToJSON(raw)
	if err != nil {
		t.Fatalf("deploy/%s: %v", kcpValuesFile, err)
	}
	var v kcpChartValues
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("deploy/%s sets more than the image, kcp.extraFlags, kcp.extraVolumes and kcp.extraVolumeMounts (or misspells one): %v", kcpValuesFile, err)
	}
	return v
}

// kcpChartDeployment is the Deployment the chart renders for component
// (server, etcd or front-proxy) as release, in kcpNamespace, with v: for
// the server, the kcp container with what v adds; for the others, only
// what the broker's side selects on (labels, ServiceAccount).
func kcpChartDeployment(v kcpChartValues, release, component string) *appsv1.Deployment {
	d := &appsv1.Deployment{}
	d.Name = release
	if !strings.Contains(release, "kcp") {
		d.Name = release + "-kcp"
	}
	if component != "server" {
		d.Name += "-" + component
	}
	d.Namespace = kcpNamespace
	d.Spec.Template.Labels = kcpChartPodLabels(release, component)
	d.Spec.Template.Spec.ServiceAccountName = kcpServiceAccount
	if component != "server" {
		return d
	}
	tag := v.KCP.Tag
	if tag == "" {
		tag = "v" + kcpChartAppVersion
	}
	c := corev1.Container{
		Name:         "kcp",
		Image:        v.KCP.Image + ":" + tag,
		Command:      []string{"/kcp", "start"},
		Args:         []string{"--root-directory="}, // one of the chart's own, for the form
		VolumeMounts: slices.Clone(v.KCP.ExtraVolumeMounts),
	}
	for _, f := range v.KCP.ExtraFlags {
		// The chart writes "- {{ . }}": YAML reads the flag again.
		var items []any
		err := yaml.Unmarshal([]byte("- "+f), &items)
		if err != nil || len(items) != 1 || items[0] != f {
			c.Args = append(c.Args, fmt.Sprintf("(%q does not render as itself: %v)", f, items))
			continue
		}
		c.Args = append(c.Args, f)
	}
	d.Spec.Template.Spec.Containers = []corev1.Container{c}
	d.Spec.Template.Spec.Volumes = slices.Clone(v.KCP.ExtraVolumes)
	return d
}

// brokerRendering is one rendering of the broker: a kustomization or a
// chart case.
type brokerRendering struct {
	name   string
	objs   []object
	d      *appsv1.Deployment
	c      *corev1.Container
	policy []byte // nil if the broker takes SVID files (no SPIRE, tunnelctl dev-ca's IDs)
}

// kcpWorld is what the checks compare: the values for kcp's chart, every
// rendering of the broker, and every rendering of the SPIRE registrations
// of the cluster kcp and the broker run in.
type kcpWorld struct {
	values   kcpChartValues
	brokers  []brokerRendering
	spire    map[string][]object // kustomization -> objects, where the broker's ClusterSPIFFEID is
	baseObjs []object            // deploy/base/broker
	baseID   spiffeid.ID         // the broker's, as deploy/base/spire registers it
}

func loadKcpWorld(t *testing.T) kcpWorld {
	t.Helper()
	w := kcpWorld{values: loadKcpChartValues(t), spire: map[string][]object{}}
	add := func(name string, objs []object) {
		for _, o := range ofKind(objs, "Deployment") {
			var d appsv1.Deployment
			o.into(t, &d)
			c := container(d.Spec.Template.Spec, "broker")
			if c == nil {
				continue
			}
			b := brokerRendering{name: name, objs: objs, d: &d, c: c}
			if _, files := flagsOf(c.Args)["svid-cert"]; !files {
				b.policy = mountedPolicy(t, objs, &d, c, flagsOf(c.Args)["policy"])
			}
			w.brokers = append(w.brokers, b)
		}
	}
	for _, k := range kustomizations(t) {
		if k.Component {
			continue
		}
		_, objs := render(t, k.Dir)
		add(k.Dir, objs)
		if _, ok := find(objs, "ClusterSPIFFEID", "", "tunnel-broker"); ok {
			w.spire[k.Dir] = objs
		}
	}
	for _, c := range casesOf("tunnel-broker") {
		_, objs := renderChart(t, c)
		add("charts/"+c.String(), objs)
	}
	_, w.baseObjs = render(t, "base/broker")
	_, spire := render(t, "base/spire")
	for _, b := range w.brokers {
		if b.name == "base/broker" {
			w.baseID, _ = spiffeIDOf(t, spire, b.d)
		}
	}
	if w.baseID.IsZero() || len(w.spire) == 0 {
		t.Fatal("deploy/base/spire does not register deploy/base/broker's broker")
	}
	return w
}

// TestDeployKcpChartValuesReachTheBroker: kcp, as kcp-dev's kcp chart runs it
// with deploy/kcp/values-kcp-chart.yaml, reaches the broker of every
// rendering in deploy/ and may dial: the values give kcp the tunnel's image,
// every tunnel flag (the broker's callers' Service and its SPIFFE ID as its
// registration makes it) and the SPIFFE CSI volume its Workload API socket
// is in, and nothing else; the ClusterSPIFFEID for kcp gives the chart's kcp
// server pods (by the chart's labels and ServiceAccount, whatever the
// release's name) an ID every broker policy lets dial, and gives the
// chart's etcd and front proxy none; and every broker's NetworkPolicy
// admits kcp's server pods to the gRPC port.
func TestDeployKcpChartValuesReachTheBroker(t *testing.T) {
	w := loadKcpWorld(t)
	t.Run("values", func(t *testing.T) {
		for _, p := range kcpValuesProblems(t, w) {
			t.Error(p)
		}
	})
	t.Run("identity", func(t *testing.T) {
		for _, p := range kcpIdentityProblems(t, w) {
			t.Error(p)
		}
	})
	t.Run("networkpolicy", func(t *testing.T) {
		for _, p := range kcpNetworkPolicyProblems(t, w) {
			t.Error(p)
		}
	})
}

// kcpTunnelFlags are the flags deploy/kcp's kcp takes besides kcp's own.
var kcpTunnelFlags = []string{
	"tunnel-broker", "tunnel-broker-spiffe-id", "tunnel-spiffe-socket",
	"tunnel-svid-cert", "tunnel-svid-key", "tunnel-trust-bundle", "tunnel-dial-timeout",
}

// kcpValuesProblems checks the values, through the Deployment the chart
// renders with them.
func kcpValuesProblems(t *testing.T, w kcpWorld) []string {
	t.Helper()
	var out []string
	v := w.values
	if _, rest, ok := imageHost(v.KCP.Image); !ok || (rest != "kcp-dev/tunnel-kcp" && !strings.HasSuffix(rest, "/kcp-dev/tunnel-kcp")) {
		out = append(out, fmt.Sprintf("kcp.image %q: want the image make images builds, %s, or <your registry>/kcp-dev/tunnel-kcp", v.KCP.Image, release.Kcp.Name))
	}
	if v.KCP.Tag == "" {
		out = append(out, "kcp.tag is not set: the chart would take its own kcp's version, v"+kcpChartAppVersion+", which tunnel-kcp does not have")
	}
	d := kcpChartDeployment(v, "kcp", "server")
	c := &d.Spec.Template.Spec.Containers[0]
	for _, a := range c.Args {
		if strings.HasPrefix(a, "(") {
			out = append(out, "kcp.extraFlags: "+a)
		}
	}
	flags := flagsOf(c.Args)
	for f := range flags {
		if strings.HasPrefix(f, "tunnel-") && !slices.Contains(kcpTunnelFlags, f) {
			out = append(out, fmt.Sprintf("kcp.extraFlags: --%s is not one of deploy/kcp's flags %v", f, kcpTunnelFlags))
		}
	}
	for _, f := range []string{"tunnel-broker", "tunnel-broker-spiffe-id", "tunnel-spiffe-socket", "tunnel-dial-timeout"} {
		if flags[f] == "" {
			out = append(out, fmt.Sprintf("kcp.extraFlags: no --%s", f))
		}
	}
	for _, f := range []string{"tunnel-svid-cert", "tunnel-svid-key", "tunnel-trust-bundle"} {
		if _, ok := flags[f]; ok {
			out = append(out, fmt.Sprintf("kcp.extraFlags: --%s with --tunnel-spiffe-socket: one source of kcp's SVID", f))
		}
	}
	if s := flags["tunnel-dial-timeout"]; s != "" {
		if dt, err := time.ParseDuration(s); err != nil || dt <= 0 {
			out = append(out, fmt.Sprintf("--tunnel-dial-timeout %q: want a positive duration", s))
		}
	}
	out = append(out, kcpWorkloadAPIProblems(d.Spec.Template.Spec, c, flags["tunnel-spiffe-socket"])...)
	out = append(out, kcpBrokerTargetProblems(t, w, flags["tunnel-broker"])...)
	if id := flags["tunnel-broker-spiffe-id"]; id != "" && id != w.baseID.String() {
		out = append(out, fmt.Sprintf("--tunnel-broker-spiffe-id %s, but deploy/base/spire gives the broker %s", id, w.baseID))
	}
	return out
}

// kcpWorkloadAPIProblems: a csi.spiffe.io volume, read-only, is mounted in
// the kcp container, and the socket is in it.
func kcpWorkloadAPIProblems(spec corev1.PodSpec, c *corev1.Container, socket string) []string {
	var out []string
	var mount string
	for _, v := range spec.Volumes {
		if v.CSI == nil || v.CSI.Driver != "csi.spiffe.io" {
			continue
		}
		if v.CSI.ReadOnly == nil || !*v.CSI.ReadOnly {
			out = append(out, fmt.Sprintf("kcp.extraVolumes: %s: the SPIFFE CSI driver needs readOnly: true", v.Name))
		}
		for _, m := range c.VolumeMounts {
			if m.Name == v.Name {
				mount = m.MountPath
			}
		}
	}
	if mount == "" {
		return append(out, "kcp.extraVolumes, kcp.extraVolumeMounts: no csi.spiffe.io volume mounted in the kcp container")
	}
	if !strings.HasPrefix(socket, "unix://"+strings.TrimSuffix(mount, "/")+"/") {
		out = append(out, fmt.Sprintf("--tunnel-spiffe-socket %q is not in the CSI mount %s", socket, mount))
	}
	return out
}

// kcpBrokerTargetProblems: --tunnel-broker is dns:///<service>.<namespace>.svc:<port>
// with the broker's callers' Service (ClusterIP) of deploy/base/broker and
// its gRPC port.
func kcpBrokerTargetProblems(t *testing.T, w kcpWorld, target string) []string {
	t.Helper()
	if target == "" {
		return nil // reported as missing
	}
	bad := func(why string) []string {
		return []string{fmt.Sprintf("--tunnel-broker %q: %s", target, why)}
	}
	addr, ok := strings.CutPrefix(target, "dns:///")
	if !ok {
		return bad("want dns:///<Service>.<namespace>.svc:<port>, every replica behind one name")
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return bad(err.Error())
	}
	parts := strings.Split(strings.TrimSuffix(host, ".cluster.local"), ".")
	if len(parts) != 3 || parts[2] != "svc" {
		return bad("want a Service's name, <name>.<namespace>.svc")
	}
	var broker *brokerRendering
	for i := range w.brokers {
		if w.brokers[i].name == "base/broker" {
			broker = &w.brokers[i]
		}
	}
	if broker == nil {
		t.Fatal("deploy/base/broker renders no broker")
	}
	grpc := listenPort(t, "--listen", flagsOf(broker.c.Args)["listen"])
	o, ok := find(w.baseObjs, "Service", parts[1], parts[0])
	if !ok {
		return bad(fmt.Sprintf("deploy/base/broker has no Service %s/%s", parts[1], parts[0]))
	}
	var s corev1.Service
	o.into(t, &s)
	if s.Spec.ClusterIP == corev1.ClusterIPNone {
		return bad("the headless Service is the agents'; callers take the ClusterIP one, which drops draining replicas")
	}
	for _, p := range s.Spec.Ports {
		tp := p.TargetPort
		if tp.Type == intstr.Int && tp.IntVal == 0 {
			tp = intstr.FromInt32(p.Port)
		}
		if strconv.Itoa(int(p.Port)) == port {
			if cp := containerPort(t, broker.c, tp); cp == nil || cp.ContainerPort != grpc {
				return bad(fmt.Sprintf("Service %s port %d is not the broker's gRPC port", s.Name, p.Port))
			}
			return nil
		}
	}
	return bad(fmt.Sprintf("Service %s has no port %s", s.Name, port))
}

// kcpIdentityProblems: in every rendering that registers the broker, one
// ClusterSPIFFEID gives kcp's server pods an ID (the same in all), and none
// gives the chart's etcd or front proxy one; every broker policy of a
// broker with SPIRE lets that ID dial.
func kcpIdentityProblems(t *testing.T, w kcpWorld) []string {
	t.Helper()
	var out []string
	var kcpID spiffeid.ID
	for _, dir := range slices.Sorted(maps.Keys(w.spire)) {
		objs := w.spire[dir]
		for _, release := range kcpChartReleases {
			id, ok := spiffeIDOf(t, objs, kcpChartDeployment(w.values, release, "server"))
			switch {
			case !ok:
				out = append(out, fmt.Sprintf("deploy/%s: no ClusterSPIFFEID selects kcp's server pods (release %s: labels %v, ServiceAccount %s, namespace %s)",
					dir, release, kcpChartPodLabels(release, "server"), kcpServiceAccount, kcpNamespace))
				continue
			case kcpID.IsZero():
				kcpID = id
			case id != kcpID:
				out = append(out, fmt.Sprintf("deploy/%s gives kcp (release %s) %s, elsewhere %s", dir, release, id, kcpID))
			}
			for _, component := range []string{"etcd", "front-proxy"} {
				if id, ok := spiffeIDOf(t, objs, kcpChartDeployment(w.values, release, component)); ok {
					out = append(out, fmt.Sprintf("deploy/%s gives the kcp chart's %s pods %s: select kcp's server pods only", dir, component, id))
				}
			}
		}
	}
	if kcpID.IsZero() {
		return out
	}
	t.Logf("kcp's SPIFFE ID: %s", kcpID)
	// SPIRE's Helm charts register every pod as
	// spiffe://<td>/ns/<namespace>/sa/<service account> by default; the
	// chart's etcd and front proxy run as kcp's ServiceAccount.
	if shared := "spiffe://" + trustDomain + "/ns/" + kcpNamespace + "/sa/" + kcpServiceAccount; kcpID.String() == shared {
		out = append(out, fmt.Sprintf("kcp's ID %s is the one SPIRE's default registration gives every pod of ServiceAccount %s in %s, the kcp chart's etcd and front proxy too", kcpID, kcpServiceAccount, kcpNamespace))
	}
	for _, b := range w.brokers {
		if b.policy == nil {
			continue
		}
		p, err := policy.Parse(b.policy)
		if err != nil {
			out = append(out, fmt.Sprintf("%s: the policy: %v", b.name, err))
			continue
		}
		if !p.IsCaller(kcpID) {
			out = append(out, fmt.Sprintf("%s: kcp's ID %s is not a caller of the broker's policy", b.name, kcpID))
		} else if err := p.MayDial(kcpID, "root"); err != nil {
			out = append(out, fmt.Sprintf("%s: %v", b.name, err))
		}
	}
	return out
}

// kcpNetworkPolicyProblems: every broker's NetworkPolicies admit kcp's
// server pods to the gRPC port; where they narrow it (a pod of another
// namespace is refused), they refuse the kcp chart's etcd and front proxy.
func kcpNetworkPolicyProblems(t *testing.T, w kcpWorld) []string {
	t.Helper()
	var out []string
	for _, b := range w.brokers {
		grpc := listenPort(t, "--listen", flagsOf(b.c.Args)["listen"])
		stranger := grpcAdmits(t, b, grpc, "elsewhere", map[string]string{"app": "stranger"})
		for _, release := range kcpChartReleases {
			if !grpcAdmits(t, b, grpc, kcpNamespace, kcpChartPodLabels(release, "server")) {
				out = append(out, fmt.Sprintf("%s: the NetworkPolicies do not admit kcp's server pods (release %s, namespace %s) to gRPC", b.name, release, kcpNamespace))
			}
			for _, component := range []string{"etcd", "front-proxy"} {
				if !stranger && grpcAdmits(t, b, grpc, kcpNamespace, kcpChartPodLabels(release, component)) {
					out = append(out, fmt.Sprintf("%s: the NetworkPolicies admit the kcp chart's %s pods to gRPC: select kcp's server pods only", b.name, component))
				}
			}
		}
	}
	return out
}

// grpcAdmits reports whether the NetworkPolicies of b's namespace that
// select its pods let a pod with podLabels in namespace ns reach port,
// as Kubernetes reads them (peers by address are not matched: pod
// addresses are not known here).
func grpcAdmits(t *testing.T, b brokerRendering, port int32, ns string, podLabels map[string]string) bool {
	t.Helper()
	match := func(sel *metav1.LabelSelector, set labels.Set) bool {
		s, err := metav1.LabelSelectorAsSelector(sel)
		if err != nil {
			t.Fatalf("%s: %v", b.name, err)
		}
		return s.Matches(set)
	}
	nsLabels := labels.Set{"kubernetes.io/metadata.name": ns}
	isolated := false
	for _, o := range ofKind(b.objs, "NetworkPolicy") {
		var np networkingv1.NetworkPolicy
		o.into(t, &np)
		if np.Namespace != b.d.Namespace || !slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) ||
			!match(&np.Spec.PodSelector, b.d.Spec.Template.Labels) {
			continue
		}
		isolated = true
		for _, rule := range np.Spec.Ingress {
			covers := len(rule.Ports) == 0
			for _, p := range rule.Ports {
				if p.Port == nil {
					covers = true
				} else if cp := containerPort(t, b.c, *p.Port); cp != nil && cp.ContainerPort == port {
					covers = true
				}
			}
			if !covers {
				continue
			}
			if len(rule.From) == 0 {
				return true
			}
			for _, peer := range rule.From {
				if peer.IPBlock != nil {
					continue
				}
				if peer.NamespaceSelector == nil && np.Namespace != ns ||
					peer.NamespaceSelector != nil && !match(peer.NamespaceSelector, nsLabels) {
					continue
				}
				if peer.PodSelector == nil || match(peer.PodSelector, podLabels) {
					return true
				}
			}
		}
	}
	return !isolated
}

// TestDeployKcpChartValuesReachTheBrokerCatches proves those checks have teeth:
// the defaults deploy/ had before it followed kcp's chart (app: kcp, kcp's
// ID from a ServiceAccount kcp), a missing flag or mount, a flag the
// chart's template would mangle, and a registration or NetworkPolicy that
// takes in the chart's etcd, are each reported.
func TestDeployKcpChartValuesReachTheBrokerCatches(t *testing.T) {
	w := loadKcpWorld(t)
	for _, check := range []func(*testing.T, kcpWorld) []string{kcpValuesProblems, kcpIdentityProblems, kcpNetworkPolicyProblems} {
		if ps := check(t, w); len(ps) > 0 {
			t.Fatalf("problems before any change: %v", ps)
		}
	}
	// editObjects returns w with every object of kind changed by change.
	editObjects := func(w kcpWorld, kind string, change func(m map[string]any)) kcpWorld {
		edit := func(objs []object) []object {
			out := slices.Clone(objs)
			for i, o := range out {
				if o.Kind != kind {
					continue
				}
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
			}
			return out
		}
		spire := map[string][]object{}
		for k, objs := range w.spire {
			spire[k] = edit(objs)
		}
		w.spire = spire
		w.brokers = slices.Clone(w.brokers)
		for i := range w.brokers {
			w.brokers[i].objs = edit(w.brokers[i].objs)
		}
		return w
	}
	kcpSelector := func(sel map[string]any) func(m map[string]any) {
		return func(m map[string]any) {
			if m["metadata"].(map[string]any)["name"] == "kcp" {
				m["spec"].(map[string]any)["podSelector"] = map[string]any{"matchLabels": sel}
			}
		}
	}
	kcpPeers := func(sel map[string]any) func(m map[string]any) {
		return func(m map[string]any) {
			rules, _ := dig(m, "spec", "ingress").([]any)
			for _, r := range rules {
				from, _ := r.(map[string]any)["from"].([]any)
				for _, p := range from {
					if ps, ok := p.(map[string]any)["podSelector"]; ok {
						ps.(map[string]any)["matchLabels"] = sel
					}
				}
			}
		}
	}
	values := func(change func(v *kcpChartValues)) kcpWorld {
		w := w
		raw, _ := json.Marshal(w.values)
		w.values = kcpChartValues{}
		if err := json.Unmarshal(raw, &w.values); err != nil {
			t.Fatal(err)
		}
		change(&w.values)
		return w
	}
	dropFlag := func(name string) func(v *kcpChartValues) {
		return func(v *kcpChartValues) {
			v.KCP.ExtraFlags = slices.DeleteFunc(v.KCP.ExtraFlags, func(f string) bool { return strings.HasPrefix(f, "--"+name+"=") })
		}
	}
	for _, c := range []struct {
		name   string
		w      kcpWorld
		check  func(*testing.T, kcpWorld) []string
		wanted string
	}{
		{"no mount", values(func(v *kcpChartValues) { v.KCP.ExtraVolumeMounts = nil }), kcpValuesProblems, "no csi.spiffe.io volume mounted"},
		{"no volume", values(func(v *kcpChartValues) { v.KCP.ExtraVolumes = nil }), kcpValuesProblems, "no csi.spiffe.io volume mounted"},
		{"socket outside the mount", values(func(v *kcpChartValues) {
			v.KCP.ExtraVolumeMounts[0].MountPath = "/run/spire"
		}), kcpValuesProblems, "is not in the CSI mount"},
		{"no broker", values(dropFlag("tunnel-broker")), kcpValuesProblems, "no --tunnel-broker"},
		{"no broker ID", values(dropFlag("tunnel-broker-spiffe-id")), kcpValuesProblems, "no --tunnel-broker-spiffe-id"},
		{"no socket", values(dropFlag("tunnel-spiffe-socket")), kcpValuesProblems, "no --tunnel-spiffe-socket"},
		{"no dial timeout", values(dropFlag("tunnel-dial-timeout")), kcpValuesProblems, "no --tunnel-dial-timeout"},
		{"the headless Service", values(func(v *kcpChartValues) {
			dropFlag("tunnel-broker")(v)
			v.KCP.ExtraFlags = append(v.KCP.ExtraFlags, "--tunnel-broker=dns:///tunnel-broker-headless.kcp-system.svc:8443")
		}), kcpValuesProblems, "the headless Service is the agents'"},
		{"another broker ID", values(func(v *kcpChartValues) {
			dropFlag("tunnel-broker-spiffe-id")(v)
			v.KCP.ExtraFlags = append(v.KCP.ExtraFlags, "--tunnel-broker-spiffe-id=spiffe://example.org/ns/kcp/sa/tunnel-broker")
		}), kcpValuesProblems, "but deploy/base/spire gives the broker"},
		{"a flag the chart's template mangles", values(func(v *kcpChartValues) {
			v.KCP.ExtraFlags = append(v.KCP.ExtraFlags, "--tunnel-dial-timeout: 10s")
		}), kcpValuesProblems, "does not render as itself"},
		{"the chart's image", values(func(v *kcpChartValues) { v.KCP.Image, v.KCP.Tag = "registry.example.com/kcp-dev/kcp", "" }), kcpValuesProblems, "kcp.image"},
		{"a name without a host", values(func(v *kcpChartValues) { v.KCP.Image = "kcp-dev/tunnel-kcp" }), kcpValuesProblems, "kcp.image"},
		{"the old registration", editObjects(w, "ClusterSPIFFEID", kcpSelector(map[string]any{"app": "kcp"})), kcpIdentityProblems,
			"no ClusterSPIFFEID selects kcp's server pods"},
		{"a registration of the whole release", editObjects(w, "ClusterSPIFFEID", kcpSelector(map[string]any{"app.kubernetes.io/name": "kcp"})), kcpIdentityProblems,
			"gives the kcp chart's etcd pods"},
		{"the old caller", func() kcpWorld {
			w := w
			w.brokers = slices.Clone(w.brokers)
			for i := range w.brokers {
				w.brokers[i].policy = bytes.ReplaceAll(w.brokers[i].policy, []byte("/ns/kcp/kcp-server"), []byte("/ns/kcp/sa/kcp"))
			}
			return w
		}(), kcpIdentityProblems, "is not a caller of the broker's policy"},
		{"the old NetworkPolicy", editObjects(w, "NetworkPolicy", kcpPeers(map[string]any{"app": "kcp"})), kcpNetworkPolicyProblems,
			"overlays/production: the NetworkPolicies do not admit kcp's server pods"},
		{"a NetworkPolicy of the whole release", editObjects(w, "NetworkPolicy", kcpPeers(map[string]any{"app.kubernetes.io/instance": "kcp"})), kcpNetworkPolicyProblems,
			"admit the kcp chart's etcd pods"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ps := c.check(t, c.w)
			if !slices.ContainsFunc(ps, func(p string) bool { return strings.Contains(p, c.wanted) }) {
				t.Errorf("no problem %q reported: %v", c.wanted, ps)
			}
		})
	}
}

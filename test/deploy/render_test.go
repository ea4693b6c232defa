package deploy

import (
	"bytes"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/template"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
)

// trustDomain is the one the manifests' policies name.
const trustDomain = "example.org"

// clusterScoped are the kinds deploy/ may render that have no namespace;
// everything else must name one, or it would land in whatever namespace the
// kubeconfig of whoever applies it points at. (The dry run checks this
// against the API server's own list.)
var clusterScoped = map[string]bool{
	"Namespace": true, "ClusterRole": true, "ClusterRoleBinding": true,
	"ClusterSPIFFEID": true, "CustomResourceDefinition": true, "PriorityClass": true,
}

// TestDeployRendersEveryKustomization renders every kustomization under
// deploy/ (Components through the overlays that use them) with kubectl
// kustomize: each must render, to objects that are all named, unique, and
// namespaced exactly when their kind is.
func TestDeployRendersEveryKustomization(t *testing.T) {
	for _, k := range kustomizations(t) {
		if k.Component {
			continue
		}
		t.Run(k.Dir, func(t *testing.T) {
			out, objs := render(t, k.Dir)
			if len(bytes.TrimSpace(out)) == 0 || len(objs) == 0 {
				t.Fatalf("kubectl kustomize deploy/%s rendered nothing", k.Dir)
			}
			seen := map[string]bool{}
			for _, o := range objs {
				if o.APIVersion == "" || o.Kind == "" || o.Name == "" {
					t.Errorf("an object without apiVersion, kind or name: %s", o.JSON)
					continue
				}
				if seen[o.String()] {
					t.Errorf("%s rendered twice", o)
				}
				seen[o.String()] = true
				switch {
				case clusterScoped[o.Kind] && o.Namespace != "":
					t.Errorf("%s: a cluster-scoped kind with a namespace", o)
				case !clusterScoped[o.Kind] && o.Namespace == "":
					t.Errorf("%s has no namespace (a cluster-scoped kind? add it to clusterScoped)", o)
				}
			}
		})
	}
	// Every Component is used by some kustomization, so it is rendered too.
	var used []string
	for _, k := range kustomizations(t) {
		raw, err := os.ReadFile(filepath.Join(deployDir(), k.Dir, "kustomization.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		var kust struct {
			Components []string `json:"components"`
		}
		if err := yaml.Unmarshal(raw, &kust); err != nil {
			t.Fatal(err)
		}
		for _, c := range kust.Components {
			used = append(used, path.Clean(path.Join(k.Dir, c)))
		}
	}
	for _, k := range kustomizations(t) {
		if k.Component && !slices.Contains(used, k.Dir) {
			t.Errorf("Component deploy/%s is used by no kustomization, so nothing renders it", k.Dir)
		}
	}
}

// TestDeployBroker asserts what an operator relies on in every rendered
// broker Deployment (base and overlays).
func TestDeployBroker(t *testing.T) {
	found := 0
	for _, k := range kustomizations(t) {
		if k.Component {
			continue
		}
		_, objs := render(t, k.Dir)
		for _, o := range ofKind(objs, "Deployment") {
			var d appsv1.Deployment
			o.into(t, &d)
			if container(d.Spec.Template.Spec, "broker") == nil {
				continue
			}
			found++
			t.Run(k.Dir, func(t *testing.T) { checkBroker(t, k, objs, &d) })
		}
	}
	if found == 0 {
		t.Fatal("no kustomization renders a Deployment with a broker container")
	}
}

func checkBroker(t *testing.T, k kustomization, objs []object, d *appsv1.Deployment) {
	pod := d.Spec.Template
	c := container(pod.Spec, "broker")

	replicas := replicasOf(d)
	if replicas < 2 {
		t.Errorf("replicas %d: want 2 or more", replicas)
	}
	selects(t, "the Deployment's selector", d.Spec.Selector, pod.Labels)
	checkAntiAffinity(t, pod)
	checkMinReady(t, d)

	flags := flagsOf(c.Args)
	checkFlagsExist(t, "broker", flags)
	for _, f := range []string{"policy", "listen", "metrics-listen"} {
		if flags[f] == "" {
			t.Errorf("no --%s", f)
		}
	}
	grpcPort := listenPort(t, "--listen", flags["listen"])
	metricsPort := listenPort(t, "--metrics-listen", flags["metrics-listen"])
	if containerPort(t, c, intstr.FromInt32(grpcPort)) == nil {
		t.Errorf("no container port %d (--listen)", grpcPort)
	}
	checkProbes(t, c, metricsPort)
	checkResources(t, c)
	checkSecurity(t, pod.Spec, c)
	if pod.Spec.AutomountServiceAccountToken == nil || *pod.Spec.AutomountServiceAccountToken {
		t.Error("the broker calls no Kubernetes API: automountServiceAccountToken must be false")
	}
	checkIdentitySource(t, pod.Spec, c, flags)
	if _, ok := find(objs, "ServiceAccount", d.Namespace, pod.Spec.ServiceAccountName); !ok || pod.Spec.ServiceAccountName == "" {
		t.Errorf("ServiceAccount %q is not rendered with the Deployment", pod.Spec.ServiceAccountName)
	}

	if !checkMountedPolicy(t, objs, d, c, flags["policy"]) {
		return
	}
	checkBrokerServices(t, objs, d, c, flags, grpcPort, metricsPort)
	checkPDB(t, objs, d, replicas)
	checkNetworkPolicy(t, objs, d, c, grpcPort, metricsPort)

	// Overlays install the broker's SPIRE registration; exactly one
	// ClusterSPIFFEID gives its pods their ID.
	if k.overlay() {
		id, ok := spiffeIDOf(t, objs, d)
		if !ok {
			t.Error("no ClusterSPIFFEID selects the broker's pods")
		} else {
			t.Logf("broker SPIFFE ID %s", id)
		}
	}
}

// checkMinReady: a rollout drains an old replica only once the agents have
// had time to find the new one, on their next resolve of the headless
// Service (--resolve-interval, 30s) and within their reconnect ceiling
// (--reconnect-max-delay, 2s): until then, only the old replicas serve
// the clusters of the agents that have not joined the new one.
func checkMinReady(t *testing.T, d *appsv1.Deployment) {
	const agentsJoin = 30 + 2 // seconds
	if d.Spec.MinReadySeconds < agentsJoin {
		t.Errorf("minReadySeconds %d: want at least %d, the agents' resolve interval and reconnect ceiling", d.Spec.MinReadySeconds, agentsJoin)
	}
}

// replicasOf is how many replicas d asks for: the API server's default of
// 1 if it says nothing.
func replicasOf(d *appsv1.Deployment) int32 {
	if d.Spec.Replicas != nil {
		return *d.Spec.Replicas
	}
	return 1
}

// checkMountedPolicy checks the broker's policy: a file in a mounted
// ConfigMap that the broker accepts. It reports false if there is no such
// file, and the checks that need it cannot go on.
func checkMountedPolicy(t *testing.T, objs []object, d *appsv1.Deployment, c *corev1.Container, path string) bool {
	t.Helper()
	pol := mountedPolicy(t, objs, d, c, path)
	if pol == nil {
		return false
	}
	if _, err := policy.Parse(pol); err != nil {
		t.Errorf("the broker would refuse its policy: %v", err)
	}
	return true
}

// TestDeployAgentSidecar asserts what the syncer-agent sidecar needs, in
// every overlay that adds it to a syncer: its flags exist and every
// variable they use is set, from a ConfigMap that is rendered with it; it is
// as locked down as the broker; its read-only RBAC is bound to the pod's
// ServiceAccount; and its SPIRE registration gives it an ID that the
// broker's policy binds to its sync target, while it expects the broker's
// ID as the broker's registration makes it.
func TestDeployAgentSidecar(t *testing.T) {
	found := 0
	for _, k := range overlays(t) {
		_, objs := render(t, k.Dir)
		for _, o := range ofKind(objs, "Deployment") {
			var d appsv1.Deployment
			o.into(t, &d)
			if container(d.Spec.Template.Spec, "syncer-agent") == nil {
				continue
			}
			found++
			t.Run(k.Dir, func(t *testing.T) { checkAgent(t, objs, &d) })
		}
	}
	if found == 0 {
		t.Fatal("no overlay renders a Deployment with the syncer-agent sidecar")
	}
}

func checkAgent(t *testing.T, objs []object, d *appsv1.Deployment) {
	pod := d.Spec.Template
	c := container(pod.Spec, "syncer-agent")
	if len(pod.Spec.Containers) < 2 {
		t.Errorf("the agent is not a sidecar: the pod has %d container(s)", len(pod.Spec.Containers))
	}
	flags := checkAgentFlags(t, objs, d, c)
	checkProbes(t, c, listenPort(t, "--metrics-listen", flags["metrics-listen"]))
	checkResources(t, c)
	checkSecurity(t, pod.Spec, c)
	checkIdentitySource(t, pod.Spec, c, flags)
	checkAgentRBAC(t, objs, d)
	checkAgentIdentity(t, objs, d, flags)
}

// checkAgentFlags checks the agent's flags, once expanded from its
// environment: they exist, name a broker and a cluster to serve, and leave
// the in-cluster config alone. It returns them, for the other checks.
func checkAgentFlags(t *testing.T, objs []object, d *appsv1.Deployment, c *corev1.Container) map[string]string {
	t.Helper()
	env := containerEnv(t, objs, d.Namespace, c)
	var args []string
	for _, a := range c.Args {
		args = append(args, expand(t, a, env))
	}
	flags := flagsOf(args)
	checkFlagsExist(t, "syncer-agent", flags)
	if flags["broker-dns"] == "" && flags["broker"] == "" && flags["broker-lb"] == "" {
		t.Error("none of --broker-dns, --broker-lb and --broker is set")
	}
	if dns := flags["broker-dns"]; dns != "" {
		if _, _, err := net.SplitHostPort(dns); err != nil {
			t.Errorf("--broker-dns %q: %v", dns, err)
		}
	}
	if flags["sync-target-name"] == "" && flags["plain-cluster"] == "" {
		t.Error("neither --sync-target-name nor --plain-cluster is set")
	}
	if _, ok := flags["kubeconfig"]; ok {
		t.Error("the sidecar should read its cluster with the in-cluster config, not --kubeconfig")
	}
	return flags
}

// checkAgentRBAC checks the agent's RBAC: bound to the pod's
// ServiceAccount, read-only, only what the agent resolves dials with.
func checkAgentRBAC(t *testing.T, objs []object, d *appsv1.Deployment) {
	t.Helper()
	sa := d.Spec.Template.Spec.ServiceAccountName
	if sa == "" {
		t.Fatal("the syncer pod has no serviceAccountName")
	}
	var granted [][]string
	for _, o := range ofKind(objs, "ClusterRoleBinding") {
		var b rbacv1.ClusterRoleBinding
		o.into(t, &b)
		if !slices.ContainsFunc(b.Subjects, func(s rbacv1.Subject) bool {
			return s.Kind == "ServiceAccount" && s.Name == sa && s.Namespace == d.Namespace
		}) {
			continue
		}
		ro, ok := find(objs, "ClusterRole", "", b.RoleRef.Name)
		if !ok {
			continue // the syncer's own binding
		}
		var role rbacv1.ClusterRole
		ro.into(t, &role)
		for _, r := range role.Rules {
			for _, res := range r.Resources {
				granted = append(granted, []string{res, strings.Join(r.Verbs, ",")})
				for _, v := range r.Verbs {
					if v != "get" && v != "list" && v != "watch" {
						t.Errorf("ClusterRole %s grants %s on %s: the agent writes nothing", role.Name, v, res)
					}
				}
			}
		}
	}
	for _, res := range []string{"namespaces", "services", "endpointslices", "pods"} {
		if !slices.ContainsFunc(granted, func(g []string) bool { return g[0] == res && g[1] == "get,list,watch" }) {
			t.Errorf("ServiceAccount %s/%s may not get, list and watch %s (granted: %v)", d.Namespace, sa, res, granted)
		}
	}
}

// checkAgentIdentity checks the identities: the agent's, from its
// ClusterSPIFFEID, is an agent of the broker's policy for its sync target;
// the broker's, from its own, is the one the agent expects.
func checkAgentIdentity(t *testing.T, objs []object, d *appsv1.Deployment, flags map[string]string) {
	t.Helper()
	id, ok := spiffeIDOf(t, objs, d)
	if !ok {
		t.Fatal("no ClusterSPIFFEID selects the syncer pods")
	}
	t.Logf("agent SPIFFE ID %s", id)
	brokerID, policies := brokerIdentityAndPolicies(t)
	if want := flags["broker-spiffe-id"]; want != "" && want != brokerID.String() {
		t.Errorf("--broker-spiffe-id %s, but the broker's ClusterSPIFFEID gives it %s", want, brokerID)
	}
	target := flags["sync-target-name"]
	admitted := false
	for dir, raw := range policies {
		p, err := policy.Parse(raw)
		if err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		var f policy.File
		if err := yaml.Unmarshal(raw, &f); err != nil {
			t.Fatal(err)
		}
		clusters, bound := f.SyncTargets[target]
		if p.IsAgent(id) && bound && p.MayServe(id, clusters) == nil {
			t.Logf("deploy/%s's policy admits %s for sync target %s: %v", dir, id, target, clusters)
			admitted = true
		}
	}
	if !admitted {
		t.Errorf("no broker policy in deploy/ admits %s as the agent of sync target %q", id, target)
	}
}

// brokerIdentityAndPolicies renders the base broker and SPIRE registrations:
// the broker's SPIFFE ID, and the policy of every rendered broker.
func brokerIdentityAndPolicies(t *testing.T) (spiffeid.ID, map[string][]byte) {
	t.Helper()
	var id spiffeid.ID
	policies := map[string][]byte{}
	for _, k := range kustomizations(t) {
		if k.Component {
			continue
		}
		_, objs := render(t, k.Dir)
		for _, o := range ofKind(objs, "Deployment") {
			var d appsv1.Deployment
			o.into(t, &d)
			c := container(d.Spec.Template.Spec, "broker")
			if c == nil {
				continue
			}
			if raw := mountedPolicy(t, objs, &d, c, flagsOf(c.Args)["policy"]); raw != nil {
				policies[k.Dir] = raw
			}
			if k.overlay() && id.IsZero() {
				id, _ = spiffeIDOf(t, objs, &d)
			}
		}
	}
	if id.IsZero() {
		t.Fatal("no overlay renders the broker with its ClusterSPIFFEID")
	}
	return id, policies
}

func container(spec corev1.PodSpec, name string) *corev1.Container {
	for i := range spec.Containers {
		if spec.Containers[i].Name == name {
			return &spec.Containers[i]
		}
	}
	return nil
}

// flagsOf maps each --name=value (or -name=value, or a bare boolean) to its
// value.
func flagsOf(args []string) map[string]string {
	flags := map[string]string{}
	for _, a := range args {
		if !strings.HasPrefix(a, "-") {
			continue
		}
		name, value, ok := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if !ok {
			value = "true"
		}
		flags[name] = value
	}
	return flags
}

// checkFlagsExist checks every flag against the binary's -h, so that a
// renamed flag fails here and not in a crash-looping pod.
func checkFlagsExist(t *testing.T, binary string, flags map[string]string) {
	t.Helper()
	known := binaryFlags(t, binary)
	for f := range flags {
		if !known[f] {
			t.Errorf("%s has no flag -%s", binary, f)
		}
	}
}

var flagLine = regexp.MustCompile(`(?m)^\s+-([a-z0-9-]+)`)

func binaryFlags(t *testing.T, binary string) map[string]bool {
	t.Helper()
	dir := os.Getenv("TUNNEL_BIN_DIR")
	if dir == "" {
		t.Fatal("TUNNEL_BIN_DIR is not set (TestMain builds the binaries)")
	}
	out, _ := exec.Command(filepath.Join(dir, binary), "-h").CombinedOutput() // the usage, on stdout
	known := map[string]bool{}
	for _, m := range flagLine.FindAllStringSubmatch(string(out), -1) {
		known[m[1]] = true
	}
	if len(known) == 0 {
		t.Fatalf("%s -h lists no flags:\n%s", binary, out)
	}
	return known
}

// listenPort is the port of a listen address such as ":9090".
func listenPort(t *testing.T, flag, addr string) int32 {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("%s %q: %v", flag, addr, err)
	}
	n, err := strconv.ParseInt(port, 10, 32)
	if err != nil {
		t.Fatalf("%s %q: %v", flag, addr, err)
	}
	return int32(n)
}

// containerPort finds the container's port that p (a number or a name)
// refers to.
func containerPort(t *testing.T, c *corev1.Container, p intstr.IntOrString) *corev1.ContainerPort {
	t.Helper()
	for i, cp := range c.Ports {
		if (p.Type == intstr.String && cp.Name == p.StrVal) || (p.Type == intstr.Int && cp.ContainerPort == p.IntVal) {
			return &c.Ports[i]
		}
	}
	return nil
}

// checkProbes: readiness is /readyz, liveness /healthz, both on the
// metrics port; readiness must not be liveness (a not-ready replica is
// drained, not killed).
func checkProbes(t *testing.T, c *corev1.Container, metricsPort int32) {
	t.Helper()
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{
		{"readinessProbe", c.ReadinessProbe, "/readyz"},
		{"livenessProbe", c.LivenessProbe, "/healthz"},
	} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("%s: no %s with httpGet", c.Name, p.name)
			continue
		}
		if p.probe.HTTPGet.Path != p.path {
			t.Errorf("%s: %s path %q, want %q", c.Name, p.name, p.probe.HTTPGet.Path, p.path)
		}
		cp := containerPort(t, c, p.probe.HTTPGet.Port)
		if cp == nil || cp.ContainerPort != metricsPort {
			t.Errorf("%s: %s port %s is not the metrics port %d", c.Name, p.name, p.probe.HTTPGet.Port.String(), metricsPort)
		}
	}
}

func checkResources(t *testing.T, c *corev1.Container) {
	t.Helper()
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if _, ok := c.Resources.Requests[r]; !ok {
			t.Errorf("%s: no %s request", c.Name, r)
		}
	}
	if _, ok := c.Resources.Limits[corev1.ResourceMemory]; !ok {
		t.Errorf("%s: no memory limit", c.Name)
	}
}

// checkSecurity: non-root, read-only root filesystem, no privilege
// escalation, no capabilities, RuntimeDefault seccomp; what the container
// sets overrides the pod.
func checkSecurity(t *testing.T, spec corev1.PodSpec, c *corev1.Container) {
	t.Helper()
	psc := spec.SecurityContext
	if psc == nil {
		psc = &corev1.PodSecurityContext{}
	}
	csc := c.SecurityContext
	if csc == nil {
		t.Fatalf("%s: no securityContext", c.Name)
	}
	nonRoot := csc.RunAsNonRoot
	if nonRoot == nil {
		nonRoot = psc.RunAsNonRoot
	}
	if nonRoot == nil || !*nonRoot {
		t.Errorf("%s: runAsNonRoot is not true", c.Name)
	}
	user := csc.RunAsUser
	if user == nil {
		user = psc.RunAsUser
	}
	if user != nil && *user == 0 {
		t.Errorf("%s: runAsUser 0", c.Name)
	}
	if csc.ReadOnlyRootFilesystem == nil || !*csc.ReadOnlyRootFilesystem {
		t.Errorf("%s: readOnlyRootFilesystem is not true", c.Name)
	}
	if csc.AllowPrivilegeEscalation == nil || *csc.AllowPrivilegeEscalation {
		t.Errorf("%s: allowPrivilegeEscalation is not false", c.Name)
	}
	if csc.Capabilities == nil || !slices.Contains(csc.Capabilities.Drop, "ALL") || len(csc.Capabilities.Add) > 0 {
		t.Errorf("%s: capabilities must drop ALL and add none: %+v", c.Name, csc.Capabilities)
	}
	seccomp := csc.SeccompProfile
	if seccomp == nil {
		seccomp = psc.SeccompProfile
	}
	if seccomp == nil || seccomp.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("%s: seccompProfile is not RuntimeDefault", c.Name)
	}
}

// checkIdentitySource checks where the container takes its SVID from:
// SVID files (--svid-cert) or else the Workload API.
func checkIdentitySource(t *testing.T, spec corev1.PodSpec, c *corev1.Container, flags map[string]string) {
	t.Helper()
	if _, ok := flags["svid-cert"]; ok {
		checkSVIDSecret(t, spec, c, flags)
		return
	}
	checkWorkloadAPI(t, spec, c, flags)
}

// checkSVIDSecret: --svid-cert, --svid-key and --trust-bundle name the keys
// tls.crt, tls.key and ca.crt (what tunnelctl dev-ca and cert-manager
// write) of one mounted Secret, and the Workload API is not asked.
func checkSVIDSecret(t *testing.T, spec corev1.PodSpec, c *corev1.Container, flags map[string]string) {
	t.Helper()
	secrets := map[string]string{} // mount path -> Secret
	for _, v := range spec.Volumes {
		if v.Secret == nil {
			continue
		}
		if len(v.Secret.Items) > 0 {
			t.Errorf("volume %s: items rename the Secret's keys; the SVID files are its keys", v.Name)
		}
		for _, m := range c.VolumeMounts {
			if m.Name == v.Name && m.SubPath == "" {
				secrets[path.Clean(m.MountPath)] = v.Secret.SecretName
			}
		}
	}
	var secret string
	for flag, key := range map[string]string{"svid-cert": "tls.crt", "svid-key": "tls.key", "trust-bundle": "ca.crt"} {
		file := flags[flag]
		s, ok := secrets[path.Dir(file)]
		switch {
		case !ok:
			t.Errorf("%s: --%s %q is not in a mounted Secret (a subPath mount would not see rotations)", c.Name, flag, file)
		case path.Base(file) != key:
			t.Errorf("%s: --%s %q: want the Secret's key %s", c.Name, flag, file, key)
		case secret != "" && s != secret:
			t.Errorf("%s: the SVID files come from two Secrets, %s and %s", c.Name, secret, s)
		}
		secret = s
	}
	if flags["spiffe-socket"] != "" || slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "SPIFFE_ENDPOINT_SOCKET" }) {
		t.Errorf("%s: SVID files and the Workload API both", c.Name)
	}
}

// checkWorkloadAPI: the SPIFFE CSI driver's volume is mounted, and the
// Workload API address the binary uses is in it.
func checkWorkloadAPI(t *testing.T, spec corev1.PodSpec, c *corev1.Container, flags map[string]string) {
	t.Helper()
	var mount string
	for _, v := range spec.Volumes {
		if v.CSI == nil || v.CSI.Driver != "csi.spiffe.io" {
			continue
		}
		if v.CSI.ReadOnly == nil || !*v.CSI.ReadOnly {
			t.Errorf("volume %s: the SPIFFE CSI driver needs readOnly: true", v.Name)
		}
		for _, m := range c.VolumeMounts {
			if m.Name == v.Name {
				mount = m.MountPath
			}
		}
	}
	if mount == "" {
		t.Fatalf("%s: no csi.spiffe.io volume mounted", c.Name)
	}
	socket := flags["spiffe-socket"]
	if socket == "" {
		for _, e := range c.Env {
			if e.Name == "SPIFFE_ENDPOINT_SOCKET" {
				socket = e.Value
			}
		}
	}
	if !strings.HasPrefix(socket, "unix://"+strings.TrimSuffix(mount, "/")+"/") {
		t.Errorf("%s: Workload API %q (--spiffe-socket or SPIFFE_ENDPOINT_SOCKET) is not in the CSI mount %s", c.Name, socket, mount)
	}
	for _, f := range []string{"svid-cert", "svid-key", "trust-bundle"} {
		if _, ok := flags[f]; ok {
			t.Errorf("%s: --%s with the Workload API", c.Name, f)
		}
	}
}

// mountedPolicy returns the policy file the broker reads at path: a key of
// a ConfigMap mounted in its folder, rendered with the Deployment.
func mountedPolicy(t *testing.T, objs []object, d *appsv1.Deployment, c *corev1.Container, file string) []byte {
	t.Helper()
	for _, m := range c.VolumeMounts {
		if path.Clean(m.MountPath) != path.Dir(file) {
			continue
		}
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.Name != m.Name || v.ConfigMap == nil {
				continue
			}
			o, ok := find(objs, "ConfigMap", d.Namespace, v.ConfigMap.Name)
			if !ok {
				t.Errorf("ConfigMap %s (the policy) is not rendered", v.ConfigMap.Name)
				return nil
			}
			var cm corev1.ConfigMap
			o.into(t, &cm)
			key := path.Base(file)
			for _, item := range v.ConfigMap.Items {
				if item.Path == key {
					key = item.Key
				}
			}
			data, ok := cm.Data[key]
			if !ok {
				t.Errorf("ConfigMap %s has no key %s (--policy %s)", cm.Name, key, file)
				return nil
			}
			return []byte(data)
		}
	}
	t.Errorf("--policy %s is not in a mounted ConfigMap", file)
	return nil
}

// selects checks that selector selects a pod with podLabels.
func selects(t *testing.T, what string, selector *metav1.LabelSelector, podLabels map[string]string) bool {
	t.Helper()
	s, err := metav1.LabelSelectorAsSelector(selector)
	if err != nil {
		t.Errorf("%s: %v", what, err)
		return false
	}
	if s.Empty() {
		t.Errorf("%s is empty", what)
		return false
	}
	if !s.Matches(labels.Set(podLabels)) {
		t.Errorf("%s (%s) does not select the pods (%v)", what, s, podLabels)
		return false
	}
	return true
}

// checkAntiAffinity: replicas are kept off each other's nodes, required or
// preferred.
func checkAntiAffinity(t *testing.T, pod corev1.PodTemplateSpec) {
	t.Helper()
	var terms []corev1.PodAffinityTerm
	if a := pod.Spec.Affinity; a != nil && a.PodAntiAffinity != nil {
		terms = append(terms, a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution...)
		for _, w := range a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
			terms = append(terms, w.PodAffinityTerm)
		}
	}
	for _, term := range terms {
		s, err := metav1.LabelSelectorAsSelector(term.LabelSelector)
		if err == nil && !s.Empty() && term.TopologyKey == "kubernetes.io/hostname" && s.Matches(labels.Set(pod.Labels)) {
			return
		}
	}
	t.Error("no pod anti-affinity on kubernetes.io/hostname against the Deployment's own pods")
}

// checkBrokerServices: a headless Service for agents and a ClusterIP one for
// callers on the gRPC port, both of ready replicas, and one for metrics;
// every Service of the broker's pods targets a port the container has.
// What --replicas-dns counts, and a LoadBalancer for agents, list each
// replica from its start until it is gone: agents behind the balancer
// reach a new replica before it is ready, and the count holds a draining
// one until it goes (protocol.md §3.1).
func checkBrokerServices(t *testing.T, objs []object, d *appsv1.Deployment, c *corev1.Container, flags map[string]string, grpcPort, metricsPort int32) {
	t.Helper()
	var headless, regular, metrics, counted bool
	for _, o := range ofKind(objs, "Service") {
		var s corev1.Service
		o.into(t, &s)
		if s.Namespace != d.Namespace || len(s.Spec.Selector) == 0 ||
			!labels.SelectorFromSet(s.Spec.Selector).Matches(labels.Set(d.Spec.Template.Labels)) {
			continue
		}
		for _, p := range s.Spec.Ports {
			target := p.TargetPort
			if target.Type == intstr.Int && target.IntVal == 0 {
				target = intstr.FromInt32(p.Port)
			}
			cp := containerPort(t, c, target)
			if cp == nil {
				t.Errorf("Service %s port %s targets %s, which the broker container does not have", s.Name, p.Name, target.String())
				continue
			}
			everyReplica := false
			switch {
			case cp.ContainerPort == grpcPort && flags["replicas-dns"] == s.Name+"."+s.Namespace+".svc":
				counted, everyReplica = true, true
			case cp.ContainerPort == grpcPort && s.Spec.Type == corev1.ServiceTypeLoadBalancer:
				everyReplica = true
			case cp.ContainerPort == grpcPort && s.Spec.ClusterIP == corev1.ClusterIPNone:
				headless = true
			case cp.ContainerPort == grpcPort:
				regular = true
			case cp.ContainerPort == metricsPort:
				metrics = true
			}
			if cp.ContainerPort == grpcPort && s.Spec.PublishNotReadyAddresses != everyReplica {
				if everyReplica {
					t.Errorf("Service %s lists ready replicas only: what --replicas-dns counts, and a load balancer for agents, must list each replica from its start (publishNotReadyAddresses)", s.Name)
				} else {
					t.Errorf("Service %s publishes replicas that are not ready", s.Name)
				}
			}
		}
	}
	if !headless {
		t.Error("no headless Service (clusterIP: None) on the gRPC port, for agents' --broker-dns")
	}
	if !regular {
		t.Error("no ClusterIP Service on the gRPC port, for callers")
	}
	if !metrics {
		t.Error("no Service on the metrics port")
	}
	if flags["replicas-dns"] != "" && !counted {
		t.Errorf("--replicas-dns %s names no headless Service of the broker's pods", flags["replicas-dns"])
	}
}

// checkPDB: a PodDisruptionBudget selects the pods, lets one go and keeps
// one.
func checkPDB(t *testing.T, objs []object, d *appsv1.Deployment, replicas int32) {
	t.Helper()
	for _, o := range ofKind(objs, "PodDisruptionBudget") {
		var pdb policyv1.PodDisruptionBudget
		o.into(t, &pdb)
		if pdb.Namespace != d.Namespace {
			continue
		}
		s, err := metav1.LabelSelectorAsSelector(pdb.Spec.Selector)
		if err != nil || s.Empty() || !s.Matches(labels.Set(d.Spec.Template.Labels)) {
			continue
		}
		var allowed int
		switch {
		case pdb.Spec.MaxUnavailable != nil:
			n, err := intstr.GetScaledValueFromIntOrPercent(pdb.Spec.MaxUnavailable, int(replicas), false)
			if err != nil {
				t.Fatal(err)
			}
			allowed = n
		case pdb.Spec.MinAvailable != nil:
			n, err := intstr.GetScaledValueFromIntOrPercent(pdb.Spec.MinAvailable, int(replicas), true)
			if err != nil {
				t.Fatal(err)
			}
			allowed = int(replicas) - n
		}
		if allowed < 1 || allowed >= int(replicas) {
			t.Errorf("PodDisruptionBudget %s lets %d of %d replicas go: want at least one, not all", pdb.Name, allowed, replicas)
		}
		return
	}
	t.Error("no PodDisruptionBudget selects the broker's pods")
}

// checkNetworkPolicy: a NetworkPolicy selects the pods; it admits the gRPC
// port, and the metrics port only from the monitoring namespace.
func checkNetworkPolicy(t *testing.T, objs []object, d *appsv1.Deployment, c *corev1.Container, grpcPort, metricsPort int32) {
	t.Helper()
	covers := func(rule networkingv1.NetworkPolicyIngressRule, port int32) bool {
		if len(rule.Ports) == 0 {
			return true
		}
		for _, p := range rule.Ports {
			if p.Port == nil {
				return true
			}
			if cp := containerPort(t, c, *p.Port); cp != nil && cp.ContainerPort == port {
				return true
			}
		}
		return false
	}
	var selected, grpc, metrics bool
	for _, o := range ofKind(objs, "NetworkPolicy") {
		var np networkingv1.NetworkPolicy
		o.into(t, &np)
		s, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
		if np.Namespace != d.Namespace || err != nil || !s.Matches(labels.Set(d.Spec.Template.Labels)) ||
			!slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress) {
			continue
		}
		selected = true
		for _, rule := range np.Spec.Ingress {
			if covers(rule, grpcPort) {
				grpc = true
			}
			if !covers(rule, metricsPort) {
				continue
			}
			metrics = true
			if len(rule.From) == 0 {
				t.Errorf("NetworkPolicy %s admits the metrics port from anywhere", np.Name)
			}
			for _, peer := range rule.From {
				if peer.NamespaceSelector == nil || peer.NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] != "monitoring" {
					t.Errorf("NetworkPolicy %s admits the metrics port from %+v, not only the monitoring namespace", np.Name, peer)
				}
			}
		}
	}
	switch {
	case !selected:
		t.Error("no ingress NetworkPolicy selects the broker's pods")
	case !grpc:
		t.Error("the NetworkPolicies admit nothing to the gRPC port")
	case !metrics:
		t.Error("the NetworkPolicies admit nothing to the metrics port")
	}
}

// containerEnv resolves the container's environment as the kubelet would:
// literal values and ConfigMap keys, which must be rendered alongside.
func containerEnv(t *testing.T, objs []object, namespace string, c *corev1.Container) map[string]string {
	t.Helper()
	env := map[string]string{}
	if len(c.EnvFrom) > 0 {
		t.Errorf("%s: envFrom hides which variables are set; use env", c.Name)
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = expand(t, e.Value, env)
		case e.ValueFrom.ConfigMapKeyRef != nil:
			ref := e.ValueFrom.ConfigMapKeyRef
			o, ok := find(objs, "ConfigMap", namespace, ref.Name)
			if !ok {
				t.Errorf("%s: env %s: ConfigMap %s/%s is not rendered", c.Name, e.Name, namespace, ref.Name)
				continue
			}
			var cm corev1.ConfigMap
			o.into(t, &cm)
			v, ok := cm.Data[ref.Key]
			if !ok {
				t.Errorf("%s: env %s: ConfigMap %s has no key %s", c.Name, e.Name, cm.Name, ref.Key)
			}
			env[e.Name] = v
		default:
			env[e.Name] = "(from " + e.Name + ")" // field or resource references: set by the kubelet
		}
	}
	return env
}

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expand replaces $(VAR) as the kubelet does; an unset variable would reach
// the binary as the literal text, so it is an error.
func expand(t *testing.T, s string, env map[string]string) string {
	t.Helper()
	return varRef.ReplaceAllStringFunc(s, func(ref string) string {
		name := varRef.FindStringSubmatch(ref)[1]
		v, ok := env[name]
		if !ok {
			t.Errorf("%q uses $(%s), which the container's env does not set", s, name)
		}
		return v
	})
}

// clusterSPIFFEID is the part of spire.spiffe.io/v1alpha1 ClusterSPIFFEID
// these tests read.
// (The dry run checks the rest against the CRD's schema.)
type clusterSPIFFEID struct {
	Metadata metav1.ObjectMeta `json:"metadata"`
	Spec     struct {
		SPIFFEIDTemplate  string                `json:"spiffeIDTemplate"`
		DNSNameTemplates  []string              `json:"dnsNameTemplates"`
		NamespaceSelector *metav1.LabelSelector `json:"namespaceSelector"`
		PodSelector       *metav1.LabelSelector `json:"podSelector"`
	} `json:"spec"`
}

// spiffeIDOf finds the ClusterSPIFFEID that selects d's pods (there must be
// at most one: a pod with two entries gets two SVIDs) and renders the ID
// the SPIRE controller manager would give them, in trustDomain.
func spiffeIDOf(t *testing.T, objs []object, d *appsv1.Deployment) (spiffeid.ID, bool) {
	t.Helper()
	nsLabels := labels.Set{"kubernetes.io/metadata.name": d.Namespace}
	var ids []spiffeid.ID
	for _, o := range ofKind(objs, "ClusterSPIFFEID") {
		var c clusterSPIFFEID
		if err := json.Unmarshal(o.JSON, &c); err != nil {
			t.Fatalf("%s: %v", o, err)
		}
		match := func(sel *metav1.LabelSelector, set labels.Set) bool {
			if sel == nil {
				return true
			}
			s, err := metav1.LabelSelectorAsSelector(sel)
			if err != nil {
				t.Fatalf("ClusterSPIFFEID %s: %v", c.Metadata.Name, err)
			}
			return s.Matches(set)
		}
		if !match(c.Spec.NamespaceSelector, nsLabels) || !match(c.Spec.PodSelector, d.Spec.Template.Labels) {
			continue
		}
		tmpl, err := template.New(c.Metadata.Name).Option("missingkey=error").Parse(c.Spec.SPIFFEIDTemplate)
		if err != nil {
			t.Fatalf("ClusterSPIFFEID %s: spiffeIDTemplate: %v", c.Metadata.Name, err)
		}
		meta := d.Spec.Template.ObjectMeta
		meta.Namespace = d.Namespace
		data := struct {
			TrustDomain, ClusterName, ClusterDomain string
			PodMeta                                 *metav1.ObjectMeta
			PodSpec                                 *corev1.PodSpec
		}{trustDomain, "test", "cluster.local", &meta, &d.Spec.Template.Spec}
		var out strings.Builder
		if err := tmpl.Execute(&out, data); err != nil {
			t.Fatalf("ClusterSPIFFEID %s: spiffeIDTemplate: %v", c.Metadata.Name, err)
		}
		id, err := spiffeid.FromString(out.String())
		if err != nil {
			t.Fatalf("ClusterSPIFFEID %s renders %q: %v", c.Metadata.Name, out.String(), err)
		}
		ids = append(ids, id)
	}
	if len(ids) > 1 {
		t.Errorf("%d ClusterSPIFFEIDs select the pods of %s (%v): each would get several SVIDs", len(ids), d.Name, ids)
	}
	if len(ids) == 0 {
		return spiffeid.ID{}, false
	}
	return ids[0], true
}

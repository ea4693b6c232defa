package deploy

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

var (
	clusterOnce sync.Once
	cluster     *harness.KubeCluster
	clusterDir  string
	kubeconfig  string
	clusterErr  error
)

// kube starts the package's etcd and kube-apiserver once, and returns an
// administrator's kubeconfig.
func kube(t *testing.T) string {
	t.Helper()
	clusterOnce.Do(func() {
		clusterDir, clusterErr = os.MkdirTemp("", "deploy-")
		if clusterErr != nil {
			return
		}
		cluster, clusterErr = harness.StartKubeCluster(clusterDir)
		if clusterErr != nil {
			return
		}
		kubeconfig, clusterErr = cluster.Kubeconfig("deploy-admin", "system:masters")
	})
	if clusterErr != nil {
		t.Fatal(clusterErr)
	}
	return kubeconfig
}

func stopCluster() {
	if cluster != nil {
		cluster.Stop()
	}
	if clusterDir != "" {
		os.RemoveAll(clusterDir)
	}
}

// clusterKubectl runs kubectl against the test's kube-apiserver.
func clusterKubectl(t *testing.T, stdin []byte, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	kc := kube(t)
	return runKubectl(t, stdin, append([]string{"--kubeconfig", kc, "--cache-dir", filepath.Join(clusterDir, "kubectl-cache")}, args...)...)
}

func mustKubectl(t *testing.T, stdin []byte, args ...string) string {
	t.Helper()
	out, stderr, err := clusterKubectl(t, stdin, args...)
	if err != nil {
		t.Fatalf("kubectl %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
	}
	return out
}

// The labels the test gives the namespaces it creates: Pod Security
// "restricted", so that the API server warns of any pod template that
// breaks it (and the dry runs fail on any warning).
const podSecurityLabels = `
    pod-security.kubernetes.io/enforce: restricted
    pod-security.kubernetes.io/warn: restricted`

// setUpOnce installs the CRDs of testdata/crds and creates the namespaces
// the overlays use.
var setUpOnce sync.Once

func setUpCluster(t *testing.T) {
	t.Helper()
	setUpOnce.Do(func() {
		mustKubectl(t, nil, "apply", "--server-side", "--field-manager=deploy-test", "-f", filepath.Join("testdata", "crds"))
		mustKubectl(t, nil, "wait", "--for=condition=Established", "--timeout=60s", "-f", filepath.Join("testdata", "crds"))

		// The server-side dry run of a namespaced object needs its
		// namespace to exist; a Namespace in an overlay is not created by
		// a dry run. Create them all (and monitoring, which the
		// NetworkPolicies name).
		names := map[string]bool{"monitoring": true}
		for _, k := range overlays(t) {
			_, objs := render(t, k.Dir)
			for _, o := range objs {
				if o.Namespace != "" {
					names[o.Namespace] = true
				}
				if o.Kind == "Namespace" {
					names[o.Name] = true
				}
			}
		}
		createNamespaces(t, sortedKeys(names)...)
	})
}

// createNamespaces creates namespaces (or leaves them as they are) that
// enforce Pod Security "restricted".
func createNamespaces(t *testing.T, names ...string) {
	t.Helper()
	var b strings.Builder
	for _, n := range names {
		fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: %s\n  labels:%s\n", n, podSecurityLabels)
	}
	mustKubectl(t, []byte(b.String()), "apply", "--server-side", "--field-manager=deploy-test", "-f", "-")
}

// TestDeployServerSideDryRun applies every overlay, as rendered, to a real
// kube-apiserver with a server-side dry run (kubectl apply --server-side
// --dry-run=server): every object must be accepted, with strict field
// validation, by the API server's validation and admission (Pod Security
// "restricted" included), with no warning; and be namespaced exactly when
// the API server says its kind is.
func TestDeployServerSideDryRun(t *testing.T) {
	ovs := overlays(t)
	setUpCluster(t)
	for _, k := range ovs {
		t.Run(k.Dir, func(t *testing.T) {
			stream, objs := render(t, k.Dir)
			dryRun(t, "deploy/"+k.Dir, stream, objs)
		})
	}
}

// dryRun applies stream, rendered as objs, with a server-side dry run: every
// object must be of a kind the API server serves, namespaced exactly when
// it says the kind is, and be accepted, with no warning.
func dryRun(t *testing.T, what string, stream []byte, objs []object) {
	t.Helper()
	namespaced := apiResources(t)
	for _, o := range objs {
		scoped, known := namespaced[groupOf(o.APIVersion)+"/"+o.Kind]
		switch {
		case !known:
			t.Errorf("%s: the API server does not serve %s (a CRD missing from testdata/crds?)", o, o.APIVersion)
		case scoped && o.Namespace == "":
			t.Errorf("%s is namespaced but has no namespace", o)
		case !scoped && o.Namespace != "":
			t.Errorf("%s is cluster-scoped but has a namespace", o)
		}
	}
	out, stderr, err := clusterKubectl(t, stream,
		"apply", "--server-side", "--dry-run=server", "--field-manager=tunnel-broker-deploy", "--validate=strict", "-f", "-")
	if err != nil {
		t.Fatalf("kubectl apply --server-side --dry-run=server of %s: %v\n%s%s", what, err, out, stderr)
	}
	if strings.TrimSpace(stderr) != "" {
		t.Errorf("the API server warned about %s:\n%s", what, stderr)
	}
	applied := strings.Count(out, "serverside-applied (server dry run)")
	if applied != len(objs) {
		t.Errorf("%d of %d objects applied:\n%s", applied, len(objs), out)
	}
	t.Logf("%s: %d objects accepted", what, applied)
}

// TestDeployDryRunCatches proves the dry run has teeth: the API server
// refuses a misspelt field and a ClusterSPIFFEID without its required
// template, and warns of a pod template that breaks Pod Security.
func TestDeployDryRunCatches(t *testing.T) {
	setUpCluster(t)
	const deployment = `apiVersion: apps/v1
kind: Deployment
metadata:
  name: bad
  namespace: kcp-system
spec:
  %s: 1
  selector:
    matchLabels: {app: bad}
  template:
    metadata:
      labels: {app: bad}
    spec:
      containers:
      - name: bad
        image: bad
`
	dryRun := func(manifest string) (string, error) {
		out, stderr, err := clusterKubectl(t, []byte(manifest),
			"apply", "--server-side", "--dry-run=server", "--field-manager=tunnel-broker-deploy", "--validate=strict", "-f", "-")
		return out + stderr, err
	}
	for _, c := range []struct {
		name, manifest string
		fails          bool
		says           string
	}{
		{"misspelt field", fmt.Sprintf(deployment, "replicaz"), true, ".spec.replicaz: field not declared in schema"},
		{"pod security", fmt.Sprintf(deployment, "replicas"), false, "would violate PodSecurity"},
		{"ClusterSPIFFEID without template", `apiVersion: spire.spiffe.io/v1alpha1
kind: ClusterSPIFFEID
metadata:
  name: bad
spec:
  podSelector: {matchLabels: {app: bad}}
`, true, "spiffeIDTemplate"},
		{"ClusterSPIFFEID misspelt field", `apiVersion: spire.spiffe.io/v1alpha1
kind: ClusterSPIFFEID
metadata:
  name: bad
spec:
  spiffeIDTemplate: spiffe://example.org/bad
  podSelectr: {matchLabels: {app: bad}}
`, true, ".spec.podSelectr: field not declared in schema"},
	} {
		t.Run(c.name, func(t *testing.T) {
			out, err := dryRun(c.manifest)
			if (err != nil) != c.fails {
				t.Errorf("failed: %v, want %v:\n%s", err != nil, c.fails, out)
			}
			if !strings.Contains(out, c.says) {
				t.Errorf("kubectl does not say %q:\n%s", c.says, out)
			}
		})
	}
}

// apiResources maps "group/Kind" to whether the API server has the kind
// namespaced.
func apiResources(t *testing.T) map[string]bool {
	t.Helper()
	out := mustKubectl(t, nil, "api-resources", "--no-headers")
	kinds := map[string]bool{}
	for _, line := range strings.Split(out, "\n") {
		// NAME [SHORTNAMES] APIVERSION NAMESPACED KIND
		f := strings.Fields(line)
		if len(f) < 4 {
			continue
		}
		kinds[groupOf(f[len(f)-3])+"/"+f[len(f)-1]] = f[len(f)-2] == "true"
	}
	if !kinds["apps/Deployment"] {
		t.Fatalf("kubectl api-resources lists no Deployment:\n%s", out)
	}
	return kinds
}

// groupOf is the group of an apiVersion ("" for the core group).
func groupOf(apiVersion string) string {
	group, _, ok := strings.Cut(apiVersion, "/")
	if !ok {
		return ""
	}
	return group
}

func sortedKeys(m map[string]bool) []string { return slices.Sorted(maps.Keys(m)) }

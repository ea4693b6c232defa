// Package deploy checks the manifests in deploy/: every kustomization
// renders with kubectl kustomize; the rendered broker Deployment, its
// Services, PodDisruptionBudget, NetworkPolicy, policy and SPIRE
// registration, and the syncer-agent sidecar with its RBAC, have the
// properties an operator relies on (and match the binaries' flags); a real
// kube-apiserver accepts every overlay in a server-side dry run; the Helm
// charts in deploy/charts lint, render, pass the same checks and the same
// dry run, and render what the kustomize bases do; and the Dockerfiles
// build static binaries into non-root images.
//
// kubectl and kube-apiserver are built from the versions pinned in
// test/tools/kube (cached in .cache/kube/), helm from test/tools/helm
// (cached in .cache/), and everything runs in a
// network namespace of the tests' own (harness.RunIsolated). Run them alone
// with: go test -run Deploy ./...
package deploy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

func TestMain(m *testing.M) {
	// Outside the network namespace: build (or find cached) kubectl,
	// kube-apiserver and etcd, and the project's binaries, whose flags the
	// manifests must match, and helm. All may need the Go module proxy.
	var builtBin string
	prepare := func() error {
		if _, err := harness.KubeBinaries(); err != nil {
			return err
		}
		if _, err := harness.HelmBinary(); err != nil {
			return err
		}
		if os.Getenv("TUNNEL_BIN_DIR") == "" {
			var main harness.Main // its Fatal exits
			builtBin = harness.Binaries(&main)
			// The re-executed tests inherit it, and build nothing.
			os.Setenv("TUNNEL_BIN_DIR", builtBin)
		}
		return nil
	}
	code := harness.RunIsolated(m, prepare, func() int {
		code := m.Run()
		stopCluster()
		return code
	})
	if builtBin != "" {
		os.RemoveAll(builtBin)
	}
	os.Exit(code)
}

// repoRoot is the repository's top folder.
func repoRoot() string {
	_, self, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(self), "..", "..")
}

func deployDir() string { return filepath.Join(repoRoot(), "deploy") }

// kubectl is the kubectl built from test/tools/kube.
func kubectl(t *testing.T) string {
	t.Helper()
	dir, err := harness.KubeBinaries()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(dir, "kubectl")
}

// runKubectl runs kubectl with stdin, returning its stdout and stderr.
func runKubectl(t *testing.T, stdin []byte, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := exec.Command(kubectl(t), args...)
	// Nothing from the environment's kubeconfig may leak in.
	cmd.Env = append(os.Environ(), "KUBECONFIG="+filepath.Join(t.TempDir(), "no-kubeconfig"))
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}

// kustomization is a folder of deploy/ holding a kustomization.yaml.
type kustomization struct {
	Dir       string // relative to deploy/, with slashes
	Component bool   // kind: Component, rendered only through those that use it
}

// overlay reports whether k is one of deploy/overlays/.
func (k kustomization) overlay() bool {
	return strings.HasPrefix(k.Dir, "overlays/") && !k.Component
}

// kustomizations finds every kustomization under deploy/.
func kustomizations(t *testing.T) []kustomization {
	t.Helper()
	var ks []kustomization
	err := filepath.WalkDir(deployDir(), func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		switch d.Name() {
		case "kustomization.yaml", "kustomization.yml", "Kustomization":
		default:
			return nil
		}
		raw, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		var head struct {
			Kind string `json:"kind"`
		}
		if err := yaml.Unmarshal(raw, &head); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		rel, err := filepath.Rel(deployDir(), filepath.Dir(path))
		if err != nil {
			return err
		}
		ks = append(ks, kustomization{Dir: filepath.ToSlash(rel), Component: head.Kind == "Component"})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(ks) == 0 {
		t.Fatal("no kustomization under deploy/")
	}
	return ks
}

func overlays(t *testing.T) []kustomization {
	var out []kustomization
	for _, k := range kustomizations(t) {
		if k.overlay() {
			out = append(out, k)
		}
	}
	if len(out) == 0 {
		t.Fatal("no overlay under deploy/overlays/")
	}
	return out
}

// object is one rendered manifest.
type object struct {
	APIVersion string
	Kind       string
	Name       string
	Namespace  string
	JSON       []byte
}

func (o object) String() string {
	if o.Namespace != "" {
		return fmt.Sprintf("%s %s/%s", o.Kind, o.Namespace, o.Name)
	}
	return fmt.Sprintf("%s %s", o.Kind, o.Name)
}

// into decodes o into a typed API object, refusing fields the type does not
// have (a typo in a manifest).
func (o object) into(t *testing.T, v any) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(o.JSON))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("%s: %v", o, err)
	}
}

// rendering is kubectl kustomize's output for one folder, made once.
type rendering struct {
	once sync.Once
	yaml []byte
	objs []object
	err  error
}

var renderings sync.Map // folder relative to deploy/ -> *rendering

// render returns kubectl kustomize's output for dir (relative to deploy/)
// and the objects in it.
func render(t *testing.T, dir string) ([]byte, []object) {
	t.Helper()
	r, _ := renderings.LoadOrStore(dir, &rendering{})
	rr := r.(*rendering)
	rr.once.Do(func() {
		out, stderr, err := runKubectl(t, nil, "kustomize", filepath.Join(deployDir(), dir))
		if err != nil {
			rr.err = fmt.Errorf("kubectl kustomize deploy/%s: %v\n%s", dir, err, stderr)
			return
		}
		rr.yaml = []byte(out)
		rr.objs, rr.err = parseObjects(rr.yaml)
		if rr.err != nil {
			rr.err = fmt.Errorf("deploy/%s: %w", dir, rr.err)
		}
	})
	if rr.err != nil {
		t.Fatal(rr.err)
	}
	return rr.yaml, rr.objs
}

// parseObjects splits a YAML stream into its objects.
func parseObjects(stream []byte) ([]object, error) {
	var objs []object
	for _, doc := range strings.Split("\n"+string(stream), "\n---\n") {
		if strings.TrimSpace(doc) == "" {
			continue
		}
		j, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			return nil, err
		}
		if string(j) == "null" {
			continue // comments only (helm template's, of a template that rendered nothing)
		}
		var head struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Metadata   struct {
				Name      string `json:"name"`
				Namespace string `json:"namespace"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(j, &head); err != nil {
			return nil, err
		}
		objs = append(objs, object{
			APIVersion: head.APIVersion, Kind: head.Kind,
			Name: head.Metadata.Name, Namespace: head.Metadata.Namespace, JSON: j,
		})
	}
	return objs, nil
}

func ofKind(objs []object, kind string) []object {
	var out []object
	for _, o := range objs {
		if o.Kind == kind {
			out = append(out, o)
		}
	}
	return out
}

func find(objs []object, kind, namespace, name string) (object, bool) {
	for _, o := range objs {
		if o.Kind == kind && o.Namespace == namespace && o.Name == name {
			return o, true
		}
	}
	return object{}, false
}

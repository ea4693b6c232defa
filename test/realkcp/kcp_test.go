package realkcp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// namespace is where the tests' objects go in every workspace.
const namespace = "realkcp"

// kcpIP is kcp's address in the isolated network: it serves there, on
// kcp's default port.
const kcpIP = "192.0.2.20"

var (
	workspaces    = schema.GroupVersionResource{Group: "tenancy.kcp.io", Version: "v1alpha1", Resource: "workspaces"}
	schemas       = schema.GroupVersionResource{Group: "apis.kcp.io", Version: "v1alpha1", Resource: "apiresourceschemas"}
	exports       = schema.GroupVersionResource{Group: "apis.kcp.io", Version: "v1alpha1", Resource: "apiexports"}
	bindings      = schema.GroupVersionResource{Group: "apis.kcp.io", Version: "v1alpha1", Resource: "apibindings"}
	agentsPolicy  = []string{"a", "b", "m", "gone", "ca", "provider"}
	kcpStartLimit = 5 * time.Minute
	// workspaceRuns numbers the workspaces of this test binary.
	workspaceRuns atomic.Uint32
)

// server is a kcp process built with the tunnel patch, and the broker it
// dials webhooks through.
type server struct {
	env    *harness.Env
	broker string
	// base is kcp's admin config without a cluster path.
	base *rest.Config
	kcp  *harness.Daemon

	// physical is a real kube-apiserver (and etcd): the service cluster
	// of the provider test, read by its agent; admin writes into it.
	physical *harness.KubeCluster
	admin    kubernetes.Interface
	rbacOnce sync.Once
}

// startServer starts a broker binary, then kcp with kcpplugin dialing it as
// /kcp. Its failures end the test binary (t is a harness.Main).
func startServer(t *harness.Main) *server {
	if err := harness.CheckIsolated(); err != nil {
		t.Fatal(err)
	}
	bin, err := harness.KCPBinary()
	if err != nil {
		t.Fatal(err)
	}
	env := harness.NewEnv(t)
	// The agents of these tests, one per workspace (or provider), each
	// serving whichever logical cluster its services file names.
	pol := harness.DefaultPolicy()
	for _, name := range agentsPolicy {
		pol.Agents = append(pol.Agents, policy.AgentRule{ID: "spiffe://" + harness.TrustDomain + "/agent/" + name, Clusters: []string{"*"}})
	}
	policyFile := harness.WriteShared(t, t.TempDir(), "policy.yaml", pol)
	_, brokerAddr := env.StartBrokerProcess("--policy", policyFile)

	dir := t.TempDir()
	s := &server{env: env, broker: brokerAddr}
	if s.physical, err = harness.StartKubeCluster(t.TempDir()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.physical.Stop)
	cfg, err := s.physical.Config("test-admin", "system:masters")
	if err != nil {
		t.Fatal(err)
	}
	if s.admin, err = kubernetes.NewForConfig(cfg); err != nil {
		t.Fatal(err)
	}

	svid := env.SVID("/kcp")
	s.kcp, err = harness.StartDaemon(bin, filepath.Join(dir, "kcp.log"), []string{
		"KCP_TUNNEL_BROKER=" + brokerAddr,
		"KCP_TUNNEL_SVID_CERT=" + svid.Cert, "KCP_TUNNEL_SVID_KEY=" + svid.Key, "KCP_TUNNEL_TRUST_BUNDLE=" + svid.Bundle,
		"KCP_TUNNEL_BROKER_SPIFFE_ID=" + harness.ID("/broker").String(),
	}, "start", "--root-directory", filepath.Join(dir, "kcp"), "--bind-address", kcpIP, "--external-hostname", kcpIP,
		// The physical cluster's etcd has 2379 and 2380.
		"--embedded-etcd-client-port", "2381", "--embedded-etcd-peer-port", "2382")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.kcp.Stop() })

	// kcp writes its admin kubeconfig as it starts; its server is the root
	// workspace's URL.
	kubeconfig := filepath.Join(dir, "kcp", "admin.kubeconfig")
	if err := s.kcp.WaitReady("kcp", kcpStartLimit, func(ctx context.Context) error {
		cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return err
		}
		cfg.Host = "https://" + net.JoinHostPort(kcpIP, "6443")
		cfg.Timeout = 30 * time.Second
		s.base = cfg
		if err := s.client("root").Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Error(); err != nil {
			return err
		}
		// Ready to take workspaces.
		_, err = s.dynamic("root").Resource(workspaces).List(ctx, metav1.ListOptions{})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return s
}

// config is the admin's client config for the workspace at path (root:a).
func (s *server) config(path string) *rest.Config {
	cfg := rest.CopyConfig(s.base)
	cfg.Host = s.base.Host + "/clusters/" + path
	return cfg
}

func (s *server) client(path string) kubernetes.Interface {
	return kubernetes.NewForConfigOrDie(s.config(path))
}

func (s *server) dynamic(path string) dynamic.Interface {
	return dynamic.NewForConfigOrDie(s.config(path))
}

// workspace is a kcp workspace of the test's: its path and the logical
// cluster that kcp scheduled it to (what agents serve and the broker routes
// by).
type workspace struct {
	path, cluster string
	kube          kubernetes.Interface
	dyn           dynamic.Interface
}

// workspace creates a workspace under root, named after the test and
// numbered (kcp outlives a test: go test -count=N runs each test N times
// against it), waits until it is ready and makes namespace "realkcp" in it.
func (s *server) workspace(t *testing.T, suffix string) *workspace {
	t.Helper()
	ctx := context.Background()
	name := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(strings.TrimPrefix(t.Name(), "TestRealKCP")))
	name = fmt.Sprintf("%.40s-%s-%d", name, suffix, workspaceRuns.Add(1))
	ws := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "tenancy.kcp.io/v1alpha1", "kind": "Workspace",
		"metadata": map[string]any{"name": name},
	}}
	client := s.dynamic("root").Resource(workspaces)
	if _, err := client.Create(ctx, ws, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating workspace %s: %v", name, err)
	}
	var cluster string
	harness.Eventually(t, 2*time.Minute, "workspace "+name+" to be ready", func() bool {
		got, err := client.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		phase, _, _ := unstructured.NestedString(got.Object, "status", "phase")
		cluster, _, _ = unstructured.NestedString(got.Object, "spec", "cluster")
		return phase == "Ready" && cluster != ""
	})
	w := &workspace{path: "root:" + name, cluster: cluster}
	w.kube, w.dyn = s.client(w.path), s.dynamic(w.path)
	harness.Eventually(t, time.Minute, "namespace realkcp in "+w.path, func() bool {
		_, err := w.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{})
		return err == nil || apierrors.IsAlreadyExists(err)
	})
	t.Logf("workspace %s is logical cluster %s", w.path, w.cluster)
	return w
}

// agent runs a syncer-agent binary as /agent/<name>, serving Service
// webhooks/webhook port 443 of cluster at addr (its services file).
func (s *server) agent(t *testing.T, name, cluster, addr string) *harness.Process {
	t.Helper()
	env := &harness.Env{T: t, Dir: t.TempDir(), CA: s.env.CA}
	return env.StartAgentProcess(s.broker, "/agent/"+name, lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: cluster, Namespace: "webhooks", Name: "webhook", Ports: map[string]string{"443": addr},
	}}})
}

// plainAgent runs a syncer-agent binary as /agent/<name> in plain mode:
// serving cluster from the physical cluster's API, as the agent beside an
// api-syncagent does, with the rights of deploy/agent/rbac.yaml.
func (s *server) plainAgent(t *testing.T, name, cluster string) *harness.Process {
	t.Helper()
	s.rbacOnce.Do(func() { harness.ApplyAgentRBAC(t, s.admin) })
	kubeconfig, err := s.physical.Kubeconfig(harness.AgentUser)
	if err != nil {
		t.Fatal(err)
	}
	env := &harness.Env{T: t, Dir: t.TempDir(), CA: s.env.CA}
	return env.StartPlainAgentProcess(s.broker, "/agent/"+name, kubeconfig, cluster)
}

// errText is err's message, or "<nil>".
func errText(err error) string {
	if err == nil {
		return "<nil>"
	}
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		return status.Status().Message
	}
	return err.Error()
}

// eventually polls try until it returns true, for up to a minute, and
// fails the test with what, and the last message try returned, if it
// never does.
func eventually(t *testing.T, what string, try func() (bool, string)) string {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		ok, msg := try()
		if ok {
			return msg
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after a minute waiting for %s; the last attempt: %s", what, msg)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

package realkcp

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
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
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
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
	kcpStartLimit = 5 * time.Minute
	// workspaceRuns numbers the workspaces of this test binary.
	workspaceRuns atomic.Uint32
)

// server is the kcp an operator runs (deploy/kcp), the broker it calls
// webhooks through, and what the tests share.
type server struct {
	env *harness.Env
	// vip is the one address at which kcp and the agents reach the broker,
	// as a ClusterIP Service is: the broker restarts behind it whenever a
	// test binds an agent to its cluster (bind).
	vip    *harness.ServiceVIP
	broker string
	// base is kcp's admin config without a cluster path.
	base *rest.Config
	kcp  *harness.Daemon
	// ca issues every webhook stand-in's certificate, so that a call that
	// reached another cluster's webhook is a wrong answer the tests see,
	// not a TLS failure.
	ca *devca.CA
	// svid is kcp's SVID files; firstSVIDExpiry, when the one kcp started
	// with expired (the files rotated before any test).
	svid            devca.Files
	firstSVIDExpiry time.Time

	mu          sync.Mutex
	policy      policy.File
	brokerProc  *harness.Process
	brokerAddr  string
	brokerStops int

	// otlp receives the spans of kcp (--tracing-config-file), the brokers
	// and the agents.
	otlp *harness.OTLPReceiver

	// physical is a real kube-apiserver (and etcd): the service cluster
	// of the provider test, read by its agent; admin writes into it.
	physical *harness.KubeCluster
	admin    kubernetes.Interface
	rbacOnce sync.Once
}

// firstSVIDLifetime is how long the SVID kcp starts with is valid: it has
// expired before the first test, so every tunnel of the tests proves that kcp
// followed the rotation of its SVID files.
const firstSVIDLifetime = 20 * time.Second

// startServer starts a broker binary behind a VIP, then kcp with its
// --tunnel-* flags, calling webhooks through it as /kcp. Its failures end
// the test binary (t is a harness.Main).
func startServer(t *harness.Main) *server {
	if err := harness.CheckIsolated(); err != nil {
		t.Fatal(err)
	}
	bin, err := harness.KCPBinary()
	if err != nil {
		t.Fatal(err)
	}
	env := harness.NewEnv(t)
	ca, err := devca.New("webhook CA", "")
	if err != nil {
		t.Fatal(err)
	}
	s := &server{env: env, vip: harness.StartServiceVIP(t), ca: ca, policy: harness.DefaultPolicy(), otlp: harness.StartOTLPReceiver(t)}
	s.broker = s.vip.Addr
	s.restartBroker()

	dir := t.TempDir()
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

	s.firstSVIDExpiry = time.Now().Add(firstSVIDLifetime)
	s.svid = s.writeKCPSVID(t, s.firstSVIDExpiry)
	s.kcp, err = harness.StartDaemon(bin, filepath.Join(dir, "kcp.log"), nil,
		"start", "--root-directory", filepath.Join(dir, "kcp"), "--bind-address", kcpIP, "--external-hostname", kcpIP,
		// The physical cluster's etcd has 2379 and 2380.
		"--embedded-etcd-client-port", "2381", "--embedded-etcd-peer-port", "2382",
		"--tunnel-broker", s.broker, "--tunnel-broker-spiffe-id", harness.ID("/broker").String(),
		"--tunnel-svid-cert", s.svid.Cert, "--tunnel-svid-key", s.svid.Key, "--tunnel-trust-bundle", s.svid.Bundle,
		"--tracing-config-file", s.writeTracingConfig(t, dir))
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

	// kcp's SVID rotates, as spiffe-helper or csi-driver-spiffe rotate
	// files, once the one it started with has expired: the broker refuses
	// that one, so every tunnel after this is kcp's new SVID at work.
	time.Sleep(time.Until(s.firstSVIDExpiry))
	s.writeKCPSVID(t, time.Now().Add(24*time.Hour))
	deadline := time.Now().Add(time.Minute)
	for !strings.Contains(s.kcp.Log(), "kcp's SVID reloaded") {
		if time.Now().After(deadline) {
			t.Fatalf("kcp did not reload its rotated SVID files within a minute; its log ends:\n%s", s.kcp.LogTail())
		}
		time.Sleep(200 * time.Millisecond)
	}
	return s
}

// writeTracingConfig writes kcp's tracing configuration, as
// kube-apiserver's --tracing-config-file takes it: spans to s.otlp, every
// request sampled. kcp takes no trace from its clients (a request's
// traceparent is only a link of kcp's own root span), so only a rate of a
// million per million makes sure the call that dials a tunnel is traced.
func (s *server) writeTracingConfig(t harness.T, dir string) string {
	path := filepath.Join(dir, "tracing.yaml")
	config := fmt.Sprintf("apiVersion: apiserver.config.k8s.io/v1beta1\nkind: TracingConfiguration\nendpoint: %s\nsamplingRatePerMillion: 1000000\n", s.otlp.Addr)
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// writeKCPSVID writes kcp's SVID files, valid until notAfter.
func (s *server) writeKCPSVID(t harness.T, notAfter time.Time) devca.Files {
	f, err := s.env.CA.WriteSVID(filepath.Join(s.env.Dir, "kcp-svid"), devca.Leaf{SPIFFEID: "/kcp", NotAfter: notAfter})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// bind lets agent /agent/<name> serve cluster, and only it, as an operator
// binds each syncer or provider agent to its clusters: the broker restarts
// behind the VIP with the new policy, and kcp and the agents reconnect.
func (s *server) bind(name, cluster string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id := harness.ID("/agent/" + name).String()
	rules := []policy.AgentRule{{ID: id, Clusters: []string{cluster}}}
	for _, r := range s.policy.Agents {
		if r.ID != id {
			rules = append(rules, r)
		}
	}
	s.policy.Agents = rules
	s.restartBroker()
}

// restartBroker starts a broker with s.policy, moves the VIP to it and
// kills the one before, as a rollout's last step would. s.mu is held, or
// not needed yet.
func (s *server) restartBroker() {
	policyFile := harness.WriteShared(s.env.T, s.env.T.TempDir(), "policy.yaml", s.policy)
	proc, addr := s.env.StartBrokerProcess("--policy", policyFile, "--otlp-endpoint", s.otlp.Endpoint)
	old := s.brokerProc
	s.brokerProc, s.brokerAddr = proc, addr
	s.vip.SetEndpoints(addr)
	if old != nil {
		old.Kill()
		s.brokerStops++
	}
}

// tunnels lists the tunnels the broker holds to cluster, as tunnelctl
// tunnels --cluster does, with an operator's identity.
func (s *server) tunnels(t *testing.T, cluster string) []*tunnelv1.TunnelInfo {
	t.Helper()
	s.mu.Lock()
	addr := s.brokerAddr
	s.mu.Unlock()
	env := &harness.Env{T: t, Dir: t.TempDir(), CA: s.env.CA}
	conn := env.BrokerConn(addr, "/operator")
	defer conn.Close()
	resp, err := tunnelv1.NewAdminServiceClient(conn).ListTunnels(context.Background(), &tunnelv1.ListTunnelsRequest{Cluster: cluster, PageSize: 1000})
	if err != nil {
		t.Fatal(err)
	}
	return resp.Tunnels
}

// brokerDials is the broker's count of dials, by every caller, since it
// started (bind restarts it).
func (s *server) brokerDials(t *testing.T) float64 {
	t.Helper()
	s.mu.Lock()
	proc := s.brokerProc
	s.mu.Unlock()
	v, _ := harness.Scrape(t, proc, `kcp_tunnel_broker_dials_total{code="OK"}`)
	return v
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

// agent runs a syncer-agent binary as /agent/<name>, bound to cluster,
// serving Service webhooks/webhook port 443 of cluster at addr (its
// services file).
func (s *server) agent(t *testing.T, name, cluster, addr string) *harness.Process {
	t.Helper()
	s.bind(name, cluster)
	env := &harness.Env{T: t, Dir: t.TempDir(), CA: s.env.CA}
	return env.StartAgentProcess(s.broker, "/agent/"+name, lookupFile(cluster, map[string]string{"webhook": addr}), "--otlp-endpoint", s.otlp.Endpoint)
}

// lookupFile is an agent's services file: port 443 of each Service of
// namespace webhooks in cluster, at its address.
func lookupFile(cluster string, services map[string]string) lookup.StaticFile {
	var f lookup.StaticFile
	for _, name := range slices.Sorted(maps.Keys(services)) {
		f.Services = append(f.Services, lookup.StaticService{
			Cluster: cluster, Namespace: "webhooks", Name: name, Ports: map[string]string{"443": services[name]},
		})
	}
	return f
}

// plainAgent runs a syncer-agent binary as /agent/<name> in plain mode:
// serving cluster from the physical cluster's API, as the agent beside an
// api-syncagent does, with the rights of deploy/agent/rbac.yaml.
func (s *server) plainAgent(t *testing.T, name, cluster string) *harness.Process {
	t.Helper()
	s.bind(name, cluster)
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

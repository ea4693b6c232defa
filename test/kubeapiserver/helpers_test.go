package kubeapiserver

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The agent's identity towards the physical cluster is harness.AgentUser,
// the ServiceAccount of deploy/agent/rbac.yaml (harness.ApplyAgentRBAC).
const (
	agentUser   = harness.AgentUser
	agentPath   = "/agent/sync-target-1"
	webhookPort = 8443
)

var (
	rbacOnce sync.Once
	// worldRuns numbers the worlds of this test binary.
	worldRuns atomic.Uint32
)

// world is one test's view: the shared API server, an admin client, and a
// broker of its own with a kcp caller.
type world struct {
	t      *testing.T
	kube   *harness.KubeCluster
	admin  kubernetes.Interface
	env    *harness.Env
	broker *harness.Broker
	dialer *kcpplugin.Dialer
	// syncTarget is this test run's own: other tests' namespaces, and
	// those of this test's earlier runs, are not its.
	syncTarget lookup.SyncTarget
}

func newWorld(t *testing.T) *world {
	t.Helper()
	k := kube(t)
	cfg, err := k.Config("test-admin", "system:masters")
	if err != nil {
		t.Fatal(err)
	}
	admin, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rbacOnce.Do(func() { harness.ApplyAgentRBAC(t, admin) })
	env := harness.NewEnv(t)
	b := env.StartBroker(harness.BrokerOptions{})
	// The API server outlives a test (go test -count=N runs each test N
	// times against it) and namespaces are never gone without a namespace
	// controller, so earlier runs' namespaces are still there: the sync
	// target's UID is unique to this run, which makes the namespaces
	// located to it this run's alone.
	name := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	uid := fmt.Sprintf("%s-%d", name, worldRuns.Add(1))
	return &world{
		t: t, kube: k, admin: admin, env: env, broker: b,
		dialer:     env.Dialer(b.Addr, "/kcp"),
		syncTarget: lookup.SyncTarget{Name: "st", Cluster: "stws", UID: uid},
	}
}

// agentConfig is the agent's client config: the RBAC manifest's user.
func (w *world) agentConfig() *rest.Config {
	cfg, err := w.kube.Config(agentUser)
	if err != nil {
		w.t.Fatal(err)
	}
	return cfg
}

// startAgent runs an in-process agent whose resolver reads the API server
// as the agent's user; it registers once the caches synced. opts defaults
// to syncer mode for w.syncTarget.
func (w *world) startAgent(opts lookup.KubeOptions) *lookup.Kube {
	w.t.Helper()
	if opts.PlainCluster == "" && opts.SyncTarget == (lookup.SyncTarget{}) {
		opts.SyncTarget = w.syncTarget
	}
	cfg := w.agentConfig()
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	opts.APIServerAddrs = apiServerAddrs(w.t, cfg.Host)
	opts.Log = harness.Logger()
	k, err := lookup.NewKube(client, opts)
	if err != nil {
		w.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	w.t.Cleanup(func() { cancel(); k.Shutdown() })
	k.Start(ctx)
	syncCtx, cancelSync := context.WithTimeout(ctx, 30*time.Second)
	defer cancelSync()
	if err := k.WaitForCacheSync(syncCtx); err != nil {
		w.t.Fatal(err)
	}
	w.env.StartAgentWithResolver(w.broker.Addr, agentPath, k)
	return k
}

// apiServerAddrs is the API server's address, as the agent's main finds it
// in its kubeconfig.
func apiServerAddrs(t *testing.T, host string) []netip.Addr {
	t.Helper()
	u, err := url.Parse(host)
	if err != nil {
		t.Fatal(err)
	}
	return []netip.Addr{netip.MustParseAddr(u.Hostname())}
}

// syncedNamespace creates a downstream namespace as kcp's syncer would for
// upstream namespace ns of logical cluster cluster and sync target st, with
// the given locator annotation key; it returns its (generated) name.
func (w *world) syncedNamespace(st lookup.SyncTarget, annotation, cluster, ns string) string {
	w.t.Helper()
	locator := fmt.Sprintf(`{"syncTarget":{"cluster":%q,"name":%q,"uid":%q},"cluster":%q,"namespace":%q}`,
		st.Cluster, st.Name, st.UID, cluster, ns)
	created, err := w.admin.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		GenerateName: "kcp-",
		Annotations:  map[string]string{annotation: locator},
	}}, metav1.CreateOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return created.Name
}

// plainNamespace creates a namespace with a name of the test's own.
func (w *world) plainNamespace() string {
	w.t.Helper()
	created, err := w.admin.CoreV1().Namespaces().Create(context.Background(),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "plain-"}}, metav1.CreateOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return created.Name
}

// service creates a Service with a selector and port 443 named "https" ->
// targetPort, deleted when the test ends (harness.KubeService).
func (w *world) service(ns, name string, targetPort intstr.IntOrString) *corev1.Service {
	w.t.Helper()
	return harness.KubeService(w.t, w.admin, ns, name, targetPort)
}

// endpoint is one endpoint of a slice.
type endpoint = harness.KubeEndpoint

// mustSetEndpoints writes the EndpointSlice name of Service svc as the
// EndpointSlice controller would, after the Pods it lists
// (harness.SetKubeEndpoints).
func (w *world) mustSetEndpoints(ns, svc, name string, port int32, eps ...endpoint) {
	w.t.Helper()
	harness.SetKubeEndpoints(w.t, w.admin, ns, svc, name, port, eps...)
}

// setEndpoints creates or replaces the EndpointSlice name of Service svc as
// anyone who may write EndpointSlices can: labelled managed by managedBy,
// owned by nothing, its endpoints naming no Pod.
func (w *world) setEndpoints(ns, svc, name, managedBy string, port int32, eps ...endpoint) error {
	w.t.Helper()
	return w.writeSlice(ns, newSlice(svc, name, managedBy, port, eps...))
}

func newSlice(svc, name, managedBy string, port int32, eps ...endpoint) *discoveryv1.EndpointSlice {
	return harness.NewEndpointSlice(svc, name, managedBy, port, eps...)
}

func (w *world) writeSlice(ns string, slice *discoveryv1.EndpointSlice) error {
	return harness.WriteEndpointSlice(w.admin, ns, slice)
}

// pod creates or labels the Pod "pod-<ip>" of namespace ns, running at ip
// (harness.KubePod).
func (w *world) pod(ns string, labels map[string]string, ip string, hostNetwork bool) *corev1.Pod {
	w.t.Helper()
	return harness.KubePod(w.t, w.admin, ns, labels, ip, hostNetwork)
}

func ready(ips ...string) []endpoint {
	var eps []endpoint
	for _, ip := range ips {
		eps = append(eps, endpoint{IP: ip, Ready: true})
	}
	return eps
}

// dial opens a tunnel as kcp would and returns the greeting of the server
// it reached, or the dial's error.
func (w *world) dial(cluster, ns, svc string, port int32) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn, err := w.dialer.DialService(ctx, cluster, ns, svc, port)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("reading the greeting: %w", err)
	}
	return strings.TrimSpace(line), nil
}

// mustReach dials and fails unless the dial reached want.
func (w *world) mustReach(cluster, ns, svc string, port int32, want *server) {
	w.t.Helper()
	got, err := w.dial(cluster, ns, svc, port)
	if err != nil || got != want.name {
		w.t.Fatalf("dial %s/%s/%s:%d reached %q, %v; want %s", cluster, ns, svc, port, got, err, want.name)
	}
}

// eventuallyReach polls until a dial reaches want: the agent's caches follow
// the API server a moment after a write.
func (w *world) eventuallyReach(cluster, ns, svc string, port int32, want *server) {
	w.t.Helper()
	var got string
	var err error
	harness.Eventually(w.t, 60*time.Second, fmt.Sprintf("a dial to reach %s", want.name), func() bool {
		got, err = w.dial(cluster, ns, svc, port)
		return err == nil && got == want.name
	})
}

// wantRefusal dials and checks the gRPC code, returning the message.
func (w *world) wantRefusal(cluster, ns, svc string, port int32, want codes.Code) string {
	w.t.Helper()
	got, err := w.dial(cluster, ns, svc, port)
	if status.Code(err) != want {
		w.t.Fatalf("dial %s/%s/%s:%d = %q, %v; want code %v", cluster, ns, svc, port, got, err, want)
	}
	w.t.Logf("%s/%s/%s:%d: %v", cluster, ns, svc, port, err)
	return status.Convert(err).Message()
}

// eventuallyRefused polls until a dial gets the code.
func (w *world) eventuallyRefused(cluster, ns, svc string, port int32, want codes.Code) {
	w.t.Helper()
	var err error
	harness.Eventually(w.t, 60*time.Second, fmt.Sprintf("a dial to fail with %v", want), func() bool {
		_, err = w.dial(cluster, ns, svc, port)
		return status.Code(err) == want
	})
	w.t.Logf("%s/%s/%s:%d: %v", cluster, ns, svc, port, err)
}

var nextHost atomic.Uint32

// newIP is an address in the isolated network no other live server of this
// test binary uses: it takes 192.0.2.21 to .254 in turn, and starts over
// (servers close with their test) so that go test -count=N does not run out.
func newIP() string { return fmt.Sprintf("192.0.2.%d", 21+(nextHost.Add(1)-1)%234) }

// server is a "webhook pod": it greets each connection with its name
// (ip:port) and then echoes.
type server struct {
	name string
	ip   string
	l    net.Listener
}

func startServer(t *testing.T, port int) *server {
	t.Helper()
	ip := newIP()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, fmt.Sprint(port)))
	if err != nil {
		t.Fatal(err)
	}
	s := &server{name: l.Addr().String(), ip: ip, l: l}
	var conns sync.WaitGroup
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer conns.Done()
				defer c.Close()
				if _, err := fmt.Fprintln(c, s.name); err == nil {
					_, _ = io.Copy(c, c)
				}
			}()
		}
	}()
	t.Cleanup(func() { l.Close(); <-done; conns.Wait() })
	return s
}

// stop closes the listener: connections to it are refused from now on.
func (s *server) stop() { s.l.Close() }

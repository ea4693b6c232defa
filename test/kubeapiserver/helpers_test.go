package kubeapiserver

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The agent's identity towards the physical cluster: the ServiceAccount of
// deploy/agent/rbac.yaml, authenticated here by a client certificate with
// its user name, so it has exactly the rights that manifest grants.
const (
	rbacManifest = "../../deploy/agent/rbac.yaml"
	agentUser    = "system:serviceaccount:kcp-tunnel:kcp-tunnel-syncer-agent"
	agentPath    = "/agent/sync-target-1"
	webhookPort  = 8443
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
	rbacOnce.Do(func() { applyRBAC(t, admin) })
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

// applyRBAC creates what deploy/agent/rbac.yaml holds, as shipped.
func applyRBAC(t *testing.T, admin kubernetes.Interface) {
	ctx := context.Background()
	if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kcp-tunnel"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(rbacManifest)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	docs := utilyaml.NewYAMLReader(bufio.NewReader(f))
	for {
		doc, err := docs.Read()
		if errors.Is(err, io.EOF) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		obj, _, err := scheme.Codecs.UniversalDeserializer().Decode(doc, nil, nil)
		if err != nil {
			t.Fatalf("%s: %v", rbacManifest, err)
		}
		switch o := obj.(type) {
		case *corev1.ServiceAccount:
			_, err = admin.CoreV1().ServiceAccounts(o.Namespace).Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRole:
			_, err = admin.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		case *rbacv1.ClusterRoleBinding:
			_, err = admin.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
		default:
			t.Fatalf("%s: unexpected %T", rbacManifest, obj)
		}
		if err != nil {
			t.Fatal(err)
		}
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

// service creates a Service with a selector (so the EndpointSlice
// controller would own its slices) and port 443 named "https" -> targetPort.
// The test's cleanup deletes it, which frees its cluster IP: the shared API
// server's service range would fill up over go test -count=N otherwise.
func (w *world) service(ns, name string, targetPort intstr.IntOrString) *corev1.Service {
	w.t.Helper()
	services := w.admin.CoreV1().Services(ns)
	svc, err := services.Create(context.Background(), &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": name},
			Ports:    []corev1.ServicePort{{Name: "https", Port: 443, TargetPort: targetPort}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	t := w.t
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := services.Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("deleting Service %s/%s: %v", ns, name, err)
		}
	})
	return svc
}

// endpoint is one endpoint of a slice.
type endpoint struct {
	ip    string
	ready bool
}

// mustSetEndpoints creates or replaces the EndpointSlice name of Service
// svc as the EndpointSlice controller writes it, after the Pods it lists:
// for each endpoint, a running Pod at its address that the Service
// selects; then a slice managed by the controller and controlled by the
// Service, whose endpoints name those Pods.
func (w *world) mustSetEndpoints(ns, svc, name string, port int32, eps ...endpoint) {
	w.t.Helper()
	service, err := w.admin.CoreV1().Services(ns).Get(context.Background(), svc, metav1.GetOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	slice := newSlice(svc, name, lookup.EndpointSliceController, port, eps...)
	slice.OwnerReferences = []metav1.OwnerReference{*metav1.NewControllerRef(service, corev1.SchemeGroupVersion.WithKind("Service"))}
	for i, ep := range eps {
		pod := w.pod(ns, service.Spec.Selector, ep.ip, false)
		slice.Endpoints[i].TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: pod.Name, UID: pod.UID}
	}
	if err := w.writeSlice(ns, slice); err != nil {
		w.t.Fatal(err)
	}
}

// setEndpoints creates or replaces the EndpointSlice name of Service svc as
// anyone who may write EndpointSlices can: labelled managed by managedBy,
// owned by nothing, its endpoints naming no Pod.
func (w *world) setEndpoints(ns, svc, name, managedBy string, port int32, eps ...endpoint) error {
	w.t.Helper()
	return w.writeSlice(ns, newSlice(svc, name, managedBy, port, eps...))
}

// newSlice is an IPv4 EndpointSlice of Service svc with one port named
// "https" and the given endpoints.
func newSlice(svc, name, managedBy string, port int32, eps ...endpoint) *discoveryv1.EndpointSlice {
	portName, tcp := "https", corev1.ProtocolTCP
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			discoveryv1.LabelServiceName: svc,
			discoveryv1.LabelManagedBy:   managedBy,
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &port, Protocol: &tcp}},
	}
	for _, ep := range eps {
		ready := ep.ready
		slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{
			Addresses:  []string{ep.ip},
			Conditions: discoveryv1.EndpointConditions{Ready: &ready, Serving: &ready},
		})
	}
	return slice
}

// writeSlice creates slice in namespace ns, or replaces the one of its name.
func (w *world) writeSlice(ns string, slice *discoveryv1.EndpointSlice) error {
	ctx := context.Background()
	slices := w.admin.DiscoveryV1().EndpointSlices(ns)
	_, err := slices.Create(ctx, slice, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		var old *discoveryv1.EndpointSlice
		if old, err = slices.Get(ctx, slice.Name, metav1.GetOptions{}); err == nil {
			slice.ResourceVersion = old.ResourceVersion
			_, err = slices.Update(ctx, slice, metav1.UpdateOptions{})
		}
	}
	return err
}

// pod creates the Pod "pod-<ip>" of namespace ns with the given labels, or
// adds them to it, and writes its status as its kubelet would: running at
// ip, which is its node's address if hostNetwork. No kubelet runs here, so
// nothing else ever changes it.
func (w *world) pod(ns string, labels map[string]string, ip string, hostNetwork bool) *corev1.Pod {
	w.t.Helper()
	ctx := context.Background()
	pods := w.admin.CoreV1().Pods(ns)
	name := "pod-" + strings.ReplaceAll(ip, ".", "-")
	// Admission gives a Pod the namespace's default ServiceAccount, which
	// nothing creates here but this.
	if _, err := w.admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		w.t.Fatal(err)
	}
	p, err := pods.Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		p, err = pods.Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
			Spec: corev1.PodSpec{
				HostNetwork:                  hostNetwork,
				AutomountServiceAccountToken: new(false),
				Containers:                   []corev1.Container{{Name: "server", Image: "example.com/server"}},
			},
		}, metav1.CreateOptions{})
	case err == nil && p.Spec.HostNetwork == hostNetwork:
		if p.Labels == nil {
			p.Labels = map[string]string{}
		}
		for k, v := range labels {
			p.Labels[k] = v
		}
		p, err = pods.Update(ctx, p, metav1.UpdateOptions{})
	case err == nil:
		w.t.Fatalf("Pod %s/%s exists, with hostNetwork %v", ns, name, p.Spec.HostNetwork)
	}
	if err != nil {
		w.t.Fatal(err)
	}
	p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}}
	if hostNetwork {
		p.Status.HostIP, p.Status.HostIPs = ip, []corev1.HostIP{{IP: ip}}
	}
	p, err = pods.UpdateStatus(ctx, p, metav1.UpdateOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	return p
}

func ready(ips ...string) []endpoint {
	var eps []endpoint
	for _, ip := range ips {
		eps = append(eps, endpoint{ip: ip, ready: true})
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

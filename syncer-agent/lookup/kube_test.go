package lookup

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The agent's own sync target in these tests.
var ownTarget = SyncTarget{Name: "st1", Cluster: "stws", UID: "uid-1"}

// locator is the JSON a syncer writes for the sync target st.
func locator(st SyncTarget, cluster, namespace string) string {
	return fmt.Sprintf(`{"syncTarget":{"cluster":%q,"name":%q,"uid":%q},"cluster":%q,"namespace":%q}`,
		st.Cluster, st.Name, st.UID, cluster, namespace)
}

func namespace(name string, annotations map[string]string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: annotations}}
}

// syncedNamespace is a downstream namespace of ownTarget.
func syncedNamespace(name, cluster, upstream string) *corev1.Namespace {
	return namespace(name, map[string]string{NamespaceLocatorAnnotation: locator(ownTarget, cluster, upstream)})
}

// service has one TCP port, port -> targetPort, named name, and selects
// the Pods labelled app=name.
func service(ns, name, portName string, port int32, targetPort intstr.IntOrString) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: serviceUID(ns, name)},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": name},
			Ports:    []corev1.ServicePort{{Name: portName, Port: port, TargetPort: targetPort, Protocol: corev1.ProtocolTCP}},
		},
	}
}

// serviceUID is the UID of the test Service ns/name.
func serviceUID(ns, name string) types.UID { return types.UID("uid-of-" + ns + "-" + name) }

// endpointSlice is a slice of the Service svc as the EndpointSlice
// controller writes it: managed by it, controlled by the Service, one port
// named portName, the given endpoints, whose Pods are of namespace ns.
func endpointSlice(ns, svc, name, portName string, port int32, endpoints ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	tcp := corev1.ProtocolTCP
	eps := make([]discoveryv1.Endpoint, len(endpoints))
	for i, ep := range endpoints {
		if ep.TargetRef != nil && ep.TargetRef.Namespace == "" {
			ref := *ep.TargetRef
			ref.Namespace = ns
			ep.TargetRef = &ref
		}
		eps[i] = ep
	}
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name,
			Labels: map[string]string{
				discoveryv1.LabelServiceName: svc,
				discoveryv1.LabelManagedBy:   EndpointSliceController,
			},
			OwnerReferences: []metav1.OwnerReference{*metav1.NewControllerRef(
				&corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: svc, UID: serviceUID(ns, svc)}},
				corev1.SchemeGroupVersion.WithKind("Service"))},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &port, Protocol: &tcp}},
		Endpoints:   eps,
	}
}

// ready is a ready, serving endpoint at ips, of the Pod podName(ips[0]).
func ready(ips ...string) discoveryv1.Endpoint {
	t := true
	return discoveryv1.Endpoint{Addresses: ips, Conditions: discoveryv1.EndpointConditions{Ready: &t, Serving: &t},
		TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: podName(ips[0])}}
}

// podName names the test Pod at ip.
func podName(ip string) string {
	return "pod-" + strings.Map(func(r rune) rune {
		if ('a' <= r && r <= 'z') || ('0' <= r && r <= '9') {
			return r
		}
		return '-'
	}, strings.ToLower(ip))
}

// pod is a running Pod podName(ips[0]) of namespace ns at ips, labelled
// app=app, as its kubelet reports it.
func pod(ns, app string, ips ...string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: podName(ips[0]), Labels: map[string]string{"app": app}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ips[0]},
	}
	for _, ip := range ips {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	return p
}

// podsOf are the Pods that the slices' endpoints name, selected by svc and
// at the endpoints' addresses: the world as the EndpointSlice controller
// saw it when it wrote them.
func podsOf(svc *corev1.Service, slices ...*discoveryv1.EndpointSlice) []runtime.Object {
	var pods []runtime.Object
	seen := map[string]bool{}
	for _, s := range slices {
		for _, ep := range s.Endpoints {
			if ep.TargetRef == nil || seen[ep.TargetRef.Name] {
				continue
			}
			seen[ep.TargetRef.Name] = true
			p := pod(svc.Namespace, "", ep.Addresses...)
			p.Name, p.Labels = ep.TargetRef.Name, svc.Spec.Selector
			pods = append(pods, p)
		}
	}
	return pods
}

// startKube runs a Kube resolver over a fake clientset holding objs, synced.
func startKube(t *testing.T, opts KubeOptions, objs ...runtime.Object) (*Kube, *fake.Clientset) {
	t.Helper()
	client := fake.NewClientset(objs...)
	k, err := NewKube(client, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); k.Shutdown() })
	k.Start(ctx)
	syncCtx, cancelSync := context.WithTimeout(ctx, 30*time.Second)
	defer cancelSync()
	if err := k.WaitForCacheSync(syncCtx); err != nil {
		t.Fatal(err)
	}
	return k, client
}

func target(cluster, ns, svc string, port uint32) *tunnelv1.Target {
	return &tunnelv1.Target{Cluster: cluster, Namespace: ns, Service: svc, Port: port}
}

// mustResolve resolves and fails the test on an error.
func mustResolve(t *testing.T, r Resolver, tg *tunnelv1.Target) []string {
	t.Helper()
	addrs, err := r.Resolve(context.Background(), tg)
	if err != nil {
		t.Fatalf("Resolve(%s): %v", tg.Key(), err)
	}
	return addrs
}

// wantCode resolves and checks the error's gRPC code.
func wantCode(t *testing.T, r Resolver, tg *tunnelv1.Target, want codes.Code) string {
	t.Helper()
	addrs, err := r.Resolve(context.Background(), tg)
	if got := status.Code(err); got != want {
		t.Fatalf("Resolve(%s) = %v, %v; want code %v", tg.Key(), addrs, err, want)
	}
	return status.Convert(err).Message()
}

func mustParseScope(t *testing.T, list string) Scope {
	t.Helper()
	s, err := ParseScope(list)
	if err != nil {
		t.Fatal(err)
	}
	return s
}
func TestNewKubeRefusesBadOptions(t *testing.T) {
	for name, opts := range map[string]KubeOptions{
		"neither mode":             {},
		"both modes":               {SyncTarget: ownTarget, PlainCluster: "root"},
		"sync target name only":    {SyncTarget: SyncTarget{Name: "st1"}},
		"plain cluster is a path":  {PlainCluster: "root:org"},
		"plain cluster is invalid": {PlainCluster: "Root"},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := NewKube(fake.NewClientset(), opts); err == nil {
				t.Fatal("NewKube accepted the options")
			}
		})
	}
}

func TestKubeResolvesOnlyAfterCachesSync(t *testing.T) {
	k, err := NewKube(fake.NewClientset(), KubeOptions{PlainCluster: "root"})
	if err != nil {
		t.Fatal(err)
	}
	msg := wantCode(t, k, target("root", "default", "webhook", 443), codes.Unavailable)
	t.Log(msg)
}

func TestKubeRejectsInvalidTarget(t *testing.T) {
	k, _ := startKube(t, KubeOptions{PlainCluster: "root"})
	wantCode(t, k, target("root:org", "default", "webhook", 443), codes.InvalidArgument)
	wantCode(t, k, target("root", "default", "webhook", 0), codes.InvalidArgument)
}

func TestKubeExternalNameRefused(t *testing.T) {
	svc := service("kcp-a", "webhook", "https", 443, intstr.FromInt32(8443))
	svc.Spec.Type = corev1.ServiceTypeExternalName
	svc.Spec.ExternalName = "example.com"
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget},
		syncedNamespace("kcp-a", "c1", "default"), svc,
		endpointSlice("kcp-a", "webhook", "webhook-1", "https", 8443, ready("10.1.0.1")))
	msg := wantCode(t, k, target("c1", "default", "webhook", 443), codes.PermissionDenied)
	t.Log(msg)
}

func TestKubeServiceAndPortNotFound(t *testing.T) {
	udp := service("kcp-a", "dns", "dns", 53, intstr.FromInt32(53))
	udp.Spec.Ports[0].Protocol = corev1.ProtocolUDP
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget},
		syncedNamespace("kcp-a", "c1", "default"),
		service("kcp-a", "webhook", "https", 443, intstr.FromInt32(8443)), udp,
		endpointSlice("kcp-a", "webhook", "webhook-1", "https", 8443, ready("10.1.0.1")))
	for _, tg := range []*tunnelv1.Target{
		target("c1", "default", "nosuch", 443),  // no Service
		target("c1", "default", "webhook", 444), // no such port
		target("c1", "default", "dns", 53),      // not a TCP port
		target("c1", "other", "webhook", 443),   // no namespace mapped
		target("c9", "default", "webhook", 443), // no such cluster
	} {
		t.Log(wantCode(t, k, tg, codes.NotFound))
	}
}

// Namespaces, Services and slices added after the start are seen.
func TestKubeFollowsChanges(t *testing.T) {
	k, client := startKube(t, KubeOptions{SyncTarget: ownTarget})
	ctx := context.Background()
	tg := target("c1", "default", "webhook", 443)
	wantCode(t, k, tg, codes.NotFound)

	if _, err := client.CoreV1().Namespaces().Create(ctx, syncedNamespace("kcp-a", "c1", "default"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Services("kcp-a").Create(ctx, service("kcp-a", "webhook", "https", 443, intstr.FromInt32(8443)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the Service without endpoints", func() bool {
		_, err := k.Resolve(ctx, tg)
		return status.Code(err) == codes.Unavailable
	})
	if _, err := client.CoreV1().Pods("kcp-a").Create(ctx, pod("kcp-a", "webhook", "10.1.0.1"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.DiscoveryV1().EndpointSlices("kcp-a").Create(ctx,
		endpointSlice("kcp-a", "webhook", "webhook-1", "https", 8443, ready("10.1.0.1")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the new endpoint", func() bool {
		addrs, err := k.Resolve(ctx, tg)
		return err == nil && len(addrs) == 1 && addrs[0] == "10.1.0.1:8443"
	})
	if err := client.CoreV1().Services("kcp-a").Delete(ctx, "webhook", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the Service to be gone", func() bool {
		_, err := k.Resolve(ctx, tg)
		return status.Code(err) == codes.NotFound
	})
}

// The API server's addresses, configured or found in default/kubernetes,
// are never targets.
func TestKubeRefusesAPIServerAddresses(t *testing.T) {
	kubernetes := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "kubernetes"},
		Spec: corev1.ServiceSpec{ClusterIP: "10.96.0.1", ClusterIPs: []string{"10.96.0.1"},
			Ports: []corev1.ServicePort{{Name: "https", Port: 443, TargetPort: intstr.FromInt32(6443)}}},
	}
	apiSlice := endpointSlice("default", "kubernetes", "kubernetes", "https", 6443, ready("10.0.0.7"))
	delete(apiSlice.Labels, discoveryv1.LabelManagedBy) // the API server writes it itself
	objs := []runtime.Object{syncedNamespace("kcp-a", "c1", "default"), kubernetes, apiSlice}
	// Even a Pod that claims one of them as its own (who may write Pods'
	// status is trusted like a kubelet, but not that far).
	for i, ip := range []string{"10.96.0.1", "10.0.0.7", "192.0.2.200"} {
		name := fmt.Sprintf("svc%d", i)
		objs = append(objs, service("kcp-a", name, "https", 443, intstr.FromInt32(443)),
			endpointSlice("kcp-a", name, name, "https", 443, ready(ip)), pod("kcp-a", name, ip))
	}
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget, APIServerAddrs: []netip.Addr{netip.MustParseAddr("192.0.2.200")}}, objs...)
	for i := range 3 {
		if msg := wantCode(t, k, target("c1", "default", fmt.Sprintf("svc%d", i), 443), codes.PermissionDenied); !strings.Contains(msg, "API server") {
			t.Errorf("refused for another reason: %s", msg)
		}
	}
	// Nor is default/kubernetes itself, in plain mode where it can be
	// named, even with its slices trusted as written.
	plain, _ := startKube(t, KubeOptions{PlainCluster: "root", TrustEndpointSlicesIn: mustParseScope(t, "*")},
		namespace("default", nil), kubernetes, apiSlice)
	msg := wantCode(t, plain, target("root", "default", "kubernetes", 443), codes.PermissionDenied)
	if !strings.Contains(msg, "API server") {
		t.Errorf("refused for another reason: %s", msg)
	}
}

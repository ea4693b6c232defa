package lookup

import (
	"net/netip"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

func addressTarget(cluster, ip string, port uint32) *tunnelv1.Target {
	return &tunnelv1.Target{Cluster: cluster, Ip: ip, Port: port}
}

// withClusterIP gives svc the cluster IPs ips.
func withClusterIP(svc *corev1.Service, ips ...string) *corev1.Service {
	svc.Spec.ClusterIP, svc.Spec.ClusterIPs = ips[0], ips
	return svc
}

// addressWorld is two logical clusters in syncer mode: c1's webhook
// (cluster IP 10.96.0.10, port 443 -> 8443, endpoints 10.1.0.1 and
// 10.1.0.2) and c2's other (10.96.0.20, 443 -> 8443, endpoint 10.2.0.1),
// and the API server's Service default/kubernetes at 10.96.0.1.
func addressWorld() []runtime.Object {
	webhook := withClusterIP(service("kcp-a", "webhook", "https", 443, intstr.FromInt32(8443)), "10.96.0.10", "fd00::10")
	webhookSlice := endpointSlice("kcp-a", "webhook", "webhook-1", "https", 8443, ready("10.1.0.1"), ready("10.1.0.2"))
	other := withClusterIP(service("kcp-b", "other", "https", 443, intstr.FromInt32(8443)), "10.96.0.20")
	otherSlice := endpointSlice("kcp-b", "other", "other-1", "https", 8443, ready("10.2.0.1"))
	kubernetes := withClusterIP(&corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "kubernetes"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "https", Port: 443}}}}, "10.96.0.1")
	objs := []runtime.Object{
		syncedNamespace("kcp-a", "c1", "default"), syncedNamespace("kcp-b", "c2", "default"),
		namespace("default", nil), webhook, webhookSlice, other, otherSlice, kubernetes,
	}
	objs = append(objs, podsOf(webhook, webhookSlice)...)
	return append(objs, podsOf(other, otherSlice)...)
}

func TestKubeMapsAClusterIPToItsService(t *testing.T) {
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget}, addressWorld()...)
	for _, ip := range []string{"10.96.0.10", "fd00::10"} {
		got := mustResolve(t, k, addressTarget("c1", ip, 443))
		slices.Sort(got)
		if want := []string{"10.1.0.1:8443", "10.1.0.2:8443"}; !slices.Equal(got, want) {
			t.Errorf("cluster IP %s resolved to %v, want the webhook's endpoints %v", ip, got, want)
		}
	}
}

func TestKubeMapsAReadyEndpointToItself(t *testing.T) {
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget}, addressWorld()...)
	// kube-apiserver with --enable-aggregator-routing dials one endpoint
	// at its target port: the agent dials that endpoint, and only it.
	for range 3 {
		if got := mustResolve(t, k, addressTarget("c1", "10.1.0.2", 8443)); !slices.Equal(got, []string{"10.1.0.2:8443"}) {
			t.Fatalf("endpoint resolved to %v, want only itself", got)
		}
	}
}

func TestKubeRefusesAddressesThatAreNoServicesOfTheCluster(t *testing.T) {
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget, APIServerAddrs: []netip.Addr{netip.MustParseAddr("192.0.2.1")}},
		addressWorld()...)
	for _, c := range []struct {
		name   string
		target *tunnelv1.Target
		want   codes.Code
	}{
		{"a cluster IP of no Service", addressTarget("c1", "10.96.0.99", 443), codes.PermissionDenied},
		{"another cluster's cluster IP", addressTarget("c1", "10.96.0.20", 443), codes.PermissionDenied},
		{"another cluster's endpoint", addressTarget("c1", "10.2.0.1", 8443), codes.PermissionDenied},
		{"a port the Service does not declare", addressTarget("c1", "10.96.0.10", 8443), codes.NotFound},
		{"an endpoint at a port that is no target port", addressTarget("c1", "10.1.0.1", 22), codes.PermissionDenied},
		{"the API server's Service", addressTarget("c1", "10.96.0.1", 443), codes.PermissionDenied},
		{"the API server's address", addressTarget("c1", "192.0.2.1", 443), codes.PermissionDenied},
		{"loopback", addressTarget("c1", "127.0.0.1", 443), codes.PermissionDenied},
		{"link-local", addressTarget("c1", "169.254.169.254", 80), codes.PermissionDenied},
		{"not canonical", addressTarget("c1", "::ffff:10.96.0.10", 443), codes.InvalidArgument},
	} {
		t.Run(c.name, func(t *testing.T) { t.Log(wantCode(t, k, c.target, c.want)) })
	}
}

func TestKubeRefusesAnEndpointItDoesNotVouchFor(t *testing.T) {
	objs := addressWorld()
	// A slice someone wrote by hand for the webhook, naming an address of
	// their choice: not the EndpointSlice controller's, so not vouched for.
	forged := endpointSlice("kcp-a", "webhook", "forged", "https", 8443, ready("10.9.9.9"))
	forged.Labels[discoveryv1.LabelManagedBy] = "someone"
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget}, append(objs, forged)...)
	t.Log(wantCode(t, k, addressTarget("c1", "10.9.9.9", 8443), codes.PermissionDenied))
}

func TestKubeFollowsAddressChanges(t *testing.T) {
	k, client := startKube(t, KubeOptions{PlainCluster: "root"},
		namespace("default", nil), namespace("team", nil))
	wantCode(t, k, addressTarget("root", "10.96.0.30", 443), codes.PermissionDenied)
	svc := withClusterIP(service("team", "late", "https", 443, intstr.FromInt32(8443)), "10.96.0.30")
	slice := endpointSlice("team", "late", "late-1", "https", 8443, ready("10.3.0.1"))
	ctx := t.Context()
	if _, err := client.CoreV1().Services("team").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Pods("team").Create(ctx, podsOf(svc, slice)[0].(*corev1.Pod), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.DiscoveryV1().EndpointSlices("team").Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, "the new Service's cluster IP to resolve", func() bool {
		addrs, err := k.Resolve(ctx, addressTarget("root", "10.96.0.30", 443))
		return err == nil && slices.Equal(addrs, []string{"10.3.0.1:8443"})
	})
}

package lookup

import (
	"fmt"
	"net/netip"
	"reflect"
	"runtime"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

// fullPod is a Pod of a Deployment as the API server sends it, with the
// fields the agent has no use for filled in.
func fullPod(i int) *corev1.Pod {
	ip := fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255)
	now := metav1.Now()
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: fmt.Sprintf("webhook-7d9f8c6b5-%05d", i), Namespace: "kcp-2x3y4z5w", GenerateName: "webhook-7d9f8c6b5-",
			UID: "8e1c7a3e-2d4b-4f6a-9b1c-0123456789ab", ResourceVersion: fmt.Sprint(1000000 + i), CreationTimestamp: now,
			Labels:          map[string]string{"app": "webhook", "pod-template-hash": "7d9f8c6b5"},
			Annotations:     map[string]string{"kubectl.kubernetes.io/restartedAt": "2025-01-01T00:00:00Z"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: "webhook-7d9f8c6b5", UID: "0a1b2c3d"}},
			ManagedFields:   []metav1.ManagedFieldsEntry{{Manager: "kube-controller-manager", Operation: metav1.ManagedFieldsOperationUpdate, APIVersion: "v1"}},
		},
		Spec: corev1.PodSpec{
			NodeName: "node-1", ServiceAccountName: "webhook",
			Containers: []corev1.Container{{
				Name: "webhook", Image: "registry.example.com/webhook:v1.2.3", Args: []string{"--tls-cert-file=/certs/tls.crt"},
				Ports:     []corev1.ContainerPort{{Name: "webhook-tls", ContainerPort: 8443, Protocol: corev1.ProtocolTCP}},
				Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m")}},
			}},
		},
		Status: corev1.PodStatus{
			Phase: corev1.PodRunning, HostIP: "192.0.2.1", PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}},
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now}},
		},
	}
}

// The Pod cache keeps what vouch.go checks and nothing else, and a Pod
// slimmed twice is slimmed once.
func TestSlimPodKeepsOnlyWhatTheCheckNeeds(t *testing.T) {
	p := fullPod(1)
	deleting := metav1.Now()
	p.DeletionTimestamp = &deleting
	p.Spec.HostNetwork = true
	p.Status.Phase = corev1.PodFailed
	p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: "2001:db8::1"})
	want := &cachedPod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, Labels: p.Labels,
			ResourceVersion: p.ResourceVersion, DeletionTimestamp: &deleting},
		hostNetwork: true,
		ended:       true,
		ips:         []netip.Addr{netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("2001:db8::1")},
	}
	got, err := slim(p)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("slim(pod) = %+v\nwant %+v", got, want)
	}
	again, err := slim(got)
	if err != nil || again != got {
		t.Fatalf("slim(slim(pod)) = %+v, %v; want it unchanged", again, err)
	}

	// An API server too old to write podIPs writes podIP alone.
	old := fullPod(2)
	old.Status.PodIPs = nil
	if got := slimPod(old); !reflect.DeepEqual(got.ips, []netip.Addr{netip.MustParseAddr("10.0.0.2")}) {
		t.Errorf("podIP alone: ips = %v", got.ips)
	}
}

// BenchmarkPodCacheBytesPerPod measures what one Pod costs in the agent's
// cache (the object, its labels and the store's entry), against a
// corev1.Pod emptied of all but the same fields, and against an informer
// that keeps Pods as they come:
//
//	go test -run '^$' -bench PodCache ./syncer-agent/lookup/
func BenchmarkPodCacheBytesPerPod(b *testing.B) {
	for name, transform := range map[string]func(*corev1.Pod) any{
		"slim": func(p *corev1.Pod) any { return slimPod(p) },
		"emptied-corev1.Pod": func(p *corev1.Pod) any {
			return &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, Labels: p.Labels,
					ResourceVersion: p.ResourceVersion, DeletionTimestamp: p.DeletionTimestamp},
				Spec:   corev1.PodSpec{HostNetwork: p.Spec.HostNetwork},
				Status: corev1.PodStatus{Phase: p.Status.Phase, PodIPs: p.Status.PodIPs},
			}
		},
		"full": func(p *corev1.Pod) any { return p },
	} {
		b.Run(name, func(b *testing.B) {
			const pods = 10000
			for b.Loop() {
				store := cache.NewIndexer(cache.DeletionHandlingMetaNamespaceKeyFunc, cache.Indexers{})
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				for i := range pods {
					if err := store.Add(transform(fullPod(i))); err != nil {
						b.Fatal(err)
					}
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/pods, "bytes/pod")
				runtime.KeepAlive(store)
			}
		})
	}
}

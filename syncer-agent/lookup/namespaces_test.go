package lookup

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

// withWebhook is a namespace plus a Service "webhook" (443 -> 8443) whose one
// endpoint is a Pod at ip, so that a successful dial shows which namespace
// it used.
func withWebhook(ns *corev1.Namespace, ip string) []runtime.Object {
	return []runtime.Object{ns,
		service(ns.Name, "webhook", "https", 443, intstr.FromInt32(8443)),
		endpointSlice(ns.Name, "webhook", "webhook-abc", "https", 8443, ready(ip)),
		pod(ns.Name, "webhook", ip),
	}
}

func TestKubeSyncerModeAnnotationVariants(t *testing.T) {
	other := SyncTarget{Name: "st2", Cluster: "stws", UID: "uid-2"}
	sameNameOtherWS := SyncTarget{Name: "st1", Cluster: "otherws", UID: "uid-3"}
	var objs []runtime.Object
	add := func(name, ip string, annotations map[string]string) {
		objs = append(objs, withWebhook(namespace(name, annotations), ip)...)
	}
	add("kcp-current", "10.1.0.1", map[string]string{NamespaceLocatorAnnotation: locator(ownTarget, "c1", "default")})
	add("kcp-legacy", "10.1.0.2", map[string]string{LegacyNamespaceLocatorAnnotation: locator(ownTarget, "c2", "default")})
	add("kcp-path", "10.1.0.3", map[string]string{NamespaceLocatorAnnotation: fmt.Sprintf(
		`{"syncTarget":{"path":"stws","name":"st1","uid":"uid-1"},"cluster":"c3","namespace":"team"}`)})
	add("kcp-other-target", "10.1.0.4", map[string]string{NamespaceLocatorAnnotation: locator(other, "c4", "default")})
	add("kcp-other-ws", "10.1.0.5", map[string]string{NamespaceLocatorAnnotation: locator(sameNameOtherWS, "c5", "default")})
	add("kcp-malformed", "10.1.0.6", map[string]string{NamespaceLocatorAnnotation: `{"syncTarget":{"name":"st1"`})
	add("kcp-path-cluster", "10.1.0.7", map[string]string{NamespaceLocatorAnnotation: locator(ownTarget, "root:org", "default")})
	add("kcp-bad-namespace", "10.1.0.8", map[string]string{NamespaceLocatorAnnotation: locator(ownTarget, "c8", "Not_A_Label")})
	add("default", "10.1.0.9", nil) // not synced at all

	// A sync target is known by name plus cluster, name plus UID, or all three.
	for name, st := range map[string]SyncTarget{
		"by cluster": {Name: "st1", Cluster: "stws"},
		"by uid":     {Name: "st1", UID: "uid-1"},
		"by both":    ownTarget,
	} {
		t.Run(name, func(t *testing.T) {
			k, _ := startKube(t, KubeOptions{SyncTarget: st}, objs...)
			if got, want := k.Clusters(), []string{"c1", "c2", "c3"}; !slices.Equal(got, want) {
				t.Errorf("Clusters() = %v, want %v", got, want)
			}
			for _, c := range []struct{ cluster, namespace, want string }{
				{"c1", "default", "10.1.0.1:8443"}, // kcp.io annotation
				{"c2", "default", "10.1.0.2:8443"}, // kcp.dev annotation
				{"c3", "team", "10.1.0.3:8443"},    // syncTarget.path
			} {
				if got := mustResolve(t, k, target(c.cluster, c.namespace, "webhook", 443)); !slices.Equal(got, []string{c.want}) {
					t.Errorf("%s/%s resolved to %v, want %s", c.cluster, c.namespace, got, c.want)
				}
			}
			// Others' namespaces, and namespaces addressed by their
			// downstream name, are not found.
			for _, tg := range [][2]string{{"c4", "default"}, {"c5", "default"}, {"c1", "kcp-current"}, {"c1", "kcp-other-target"}, {"c8", "default"}} {
				wantCode(t, k, target(tg[0], tg[1], "webhook", 443), codes.NotFound)
			}
		})
	}
	t.Run("uid mismatch", func(t *testing.T) {
		k, _ := startKube(t, KubeOptions{SyncTarget: SyncTarget{Name: "st1", Cluster: "stws", UID: "uid-9"}}, objs...)
		if got := k.Clusters(); len(got) != 0 {
			t.Errorf("Clusters() = %v, want none", got)
		}
	})
}

// kcp.io wins over kcp.dev when a namespace has both.
func TestKubeCurrentAnnotationWins(t *testing.T) {
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget}, withWebhook(namespace("kcp-both", map[string]string{
		NamespaceLocatorAnnotation:       locator(ownTarget, "c1", "default"),
		LegacyNamespaceLocatorAnnotation: locator(ownTarget, "c2", "default"),
	}), "10.1.0.1")...)
	if got := k.Clusters(); !slices.Equal(got, []string{"c1"}) {
		t.Errorf("Clusters() = %v, want [c1]", got)
	}
}

// Two downstream namespaces claiming one upstream namespace: refuse, not guess.
func TestKubeAmbiguousNamespaceRefused(t *testing.T) {
	objs := append(withWebhook(syncedNamespace("kcp-one", "c1", "default"), "10.1.0.1"),
		withWebhook(syncedNamespace("kcp-two", "c1", "default"), "10.1.0.2")...)
	k, _ := startKube(t, KubeOptions{SyncTarget: ownTarget}, objs...)
	t.Log(wantCode(t, k, target("c1", "default", "webhook", 443), codes.FailedPrecondition))
}

func TestKubePlainMode(t *testing.T) {
	objs := append(withWebhook(namespace("default", nil), "10.1.0.1"),
		withWebhook(syncedNamespace("kcp-a", "c1", "default"), "10.1.0.2")...)
	k, _ := startKube(t, KubeOptions{PlainCluster: "root"}, objs...)
	if got := k.Clusters(); !slices.Equal(got, []string{"root"}) {
		t.Errorf("Clusters() = %v, want [root]", got)
	}
	if got := mustResolve(t, k, target("root", "default", "webhook", 443)); !slices.Equal(got, []string{"10.1.0.1:8443"}) {
		t.Errorf("resolved to %v", got)
	}
	t.Log(wantCode(t, k, target("c1", "default", "webhook", 443), codes.NotFound))         // another cluster
	t.Log(wantCode(t, k, target("root", "missing", "webhook", 443), codes.NotFound))       // no namespace
	t.Log(wantCode(t, k, target("root", "kcp-a", "webhook", 443), codes.PermissionDenied)) // a syncer's namespace
}

// ClustersChanged fires when a cluster comes or goes, so the agent re-registers.
func TestKubeClustersChanged(t *testing.T) {
	k, client := startKube(t, KubeOptions{SyncTarget: ownTarget}, syncedNamespace("kcp-a", "c1", "default"))
	ctx := context.Background()
	waitChanged := func(want ...string) {
		t.Helper()
		select {
		case <-k.ClustersChanged():
		case <-time.After(30 * time.Second):
			t.Fatalf("ClustersChanged did not fire; Clusters() = %v, want %v", k.Clusters(), want)
		}
		// One signal may cover several changes: wait for the last.
		testutil.Eventually(t, fmt.Sprintf("clusters %v", want), func() bool { return slices.Equal(k.Clusters(), want) })
	}
	if _, err := client.CoreV1().Namespaces().Create(ctx, syncedNamespace("kcp-b", "c2", "default"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitChanged("c1", "c2")
	if err := client.CoreV1().Namespaces().Delete(ctx, "kcp-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitChanged("c2")
}

// Each subscriber (one agent per broker replica) hears of every change.
func TestKubeSubscribersAllHearChanges(t *testing.T) {
	k, client := startKube(t, KubeOptions{SyncTarget: ownTarget}, syncedNamespace("kcp-a", "c1", "default"))
	listeners := []ClusterWatcher{k, k.Subscribe().(ClusterWatcher), k.Subscribe().(ClusterWatcher)}
	if _, err := client.CoreV1().Namespaces().Create(context.Background(), syncedNamespace("kcp-b", "c2", "default"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for i, l := range listeners {
		select {
		case <-l.ClustersChanged():
		case <-time.After(30 * time.Second):
			t.Fatalf("listener %d did not hear of the new cluster", i)
		}
	}
}

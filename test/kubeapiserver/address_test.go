package kubeapiserver

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// A target that names an address, as kube-apiserver's egress selector
// dials them: the cluster IP the real API server allocated maps to its
// Service, a ready endpoint's address to itself, and every other address
// is refused: a cluster IP of no Service, a port the Service does not
// declare, another cluster's Service, the API server's own addresses.
func TestKubeAPIServerResolvesAddresses(t *testing.T) {
	w := newWorld(t)
	ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	other := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c2", "default")
	s := startServer(t, webhookPort)
	svc := w.service(ns, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(ns, "webhook", "webhook-abcde", webhookPort, ready(s.ip)...)
	elsewhere := w.service(other, "webhook", intstr.FromInt32(webhookPort))
	k := w.startAgent(lookup.KubeOptions{})

	clusterIP := svc.Spec.ClusterIP
	resolve := func(cluster, ip string, port uint32) ([]string, error) {
		return k.Resolve(context.Background(), &tunnelv1.Target{Cluster: cluster, Ip: ip, Port: port})
	}
	want := fmt.Sprintf("%s:%d", s.ip, webhookPort)
	harness.Eventually(t, 60*time.Second, "the cluster IP to map to the webhook's endpoint", func() bool {
		got, err := resolve("c1", clusterIP, 443)
		return err == nil && slices.Equal(got, []string{want})
	})
	if got, err := resolve("c1", s.ip, webhookPort); err != nil || !slices.Equal(got, []string{want}) {
		t.Fatalf("endpoint %s resolved to %v, %v; want itself", want, got, err)
	}

	kubernetes, err := w.admin.CoreV1().Services("default").Get(context.Background(), "kubernetes", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	apiServer := apiServerAddrs(t, w.agentConfig().Host)[0]
	for _, c := range []struct {
		what string
		ip   string
		port uint32
		want codes.Code
	}{
		{"a cluster IP of no Service", w.unusedClusterIP(clusterIP), 443, codes.PermissionDenied},
		{"a port the Service does not declare", clusterIP, 444, codes.NotFound},
		{"another cluster's Service", elsewhere.Spec.ClusterIP, 443, codes.PermissionDenied},
		{"the API server's Service", kubernetes.Spec.ClusterIP, 443, codes.PermissionDenied},
		{"the API server's address", apiServer.String(), 443, codes.PermissionDenied},
	} {
		got, err := resolve("c1", c.ip, c.port)
		if status.Code(err) != c.want {
			t.Errorf("%s (%s:%d) resolved to %v, %v; want %v", c.what, c.ip, c.port, got, err, c.want)
			continue
		}
		t.Logf("%s: %v", c.what, err)
	}
}

// unusedClusterIP is an address of ip's /24 that no Service of the API
// server holds now.
func (w *world) unusedClusterIP(ip string) string {
	w.t.Helper()
	all, err := w.admin.CoreV1().Services("").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		w.t.Fatal(err)
	}
	held := map[string]bool{}
	for _, svc := range all.Items {
		for _, a := range svc.Spec.ClusterIPs {
			held[a] = true
		}
	}
	a := netip.MustParseAddr(ip).As4()
	for a[3] = 254; a[3] > 1; a[3]-- {
		if s := netip.AddrFrom4(a).String(); !held[s] {
			return s
		}
	}
	w.t.Fatalf("every address of the /24 of %s is a cluster IP", ip)
	return ""
}

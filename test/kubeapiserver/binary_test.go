package kubeapiserver

import (
	"testing"

	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The syncer-agent binary, given a kubeconfig of the user that
// deploy/agent/rbac.yaml grants rights to, resolves as the library does, and
// tells every broker replica of a cluster that appears.
func TestKubeAPIServerAgentBinary(t *testing.T) {
	w := newWorld(t)
	ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	s := startServer(t, webhookPort)
	w.service(ns, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(ns, "webhook", "webhook-abcde", webhookPort, ready(s.ip)...)
	second := w.env.StartBroker(harness.BrokerOptions{ID: "broker-1"})
	viaSecond := &world{t: t, dialer: w.env.Dialer(second.Addr, "/kcp")}

	kubeconfig, err := w.kube.Kubeconfig(agentUser)
	if err != nil {
		t.Fatal(err)
	}
	w.env.StartKubeAgentProcess(w.broker.Addr+","+second.Addr, agentPath, kubeconfig,
		"--sync-target-name", w.syncTarget.Name, "--sync-target-uid", w.syncTarget.UID)
	// It registers with each replica on its own time.
	w.eventuallyReach("c1", "default", "webhook", 443, s)
	viaSecond.eventuallyReach("c1", "default", "webhook", 443, s)

	// A workspace newly bound to the sync target reaches both replicas.
	ns2 := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c2", "default")
	w.service(ns2, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(ns2, "webhook", "webhook-fghij", webhookPort, ready(s.ip)...)
	w.eventuallyReach("c2", "default", "webhook", 443, s)
	viaSecond.eventuallyReach("c2", "default", "webhook", 443, s)
}

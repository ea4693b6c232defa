package kubeapiserver

import (
	"testing"

	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// The syncer-agent binary, given a kubeconfig of the user that
// deploy/agent/rbac.yaml grants rights to, resolves as the library does.
func TestKubeAPIServerAgentBinary(t *testing.T) {
	w := newWorld(t)
	ns := w.syncedNamespace(w.syncTarget, lookup.NamespaceLocatorAnnotation, "c1", "default")
	s := startServer(t, webhookPort)
	w.service(ns, "webhook", intstr.FromInt32(webhookPort))
	w.mustSetEndpoints(ns, "webhook", "webhook-abcde", webhookPort, ready(s.ip)...)

	kubeconfig, err := w.kube.Kubeconfig(agentUser)
	if err != nil {
		t.Fatal(err)
	}
	w.env.StartKubeAgentProcess(w.broker.Addr, agentPath, kubeconfig,
		"--sync-target-name", w.syncTarget.Name, "--sync-target-uid", w.syncTarget.UID)
	w.mustReach("c1", "default", "webhook", 443, s)
}

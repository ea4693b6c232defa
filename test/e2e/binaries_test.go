package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// TestWebhookThroughBinaries runs the built broker and syncer-agent as
// separate processes and sends admission requests through them.
func TestWebhookThroughBinaries(t *testing.T) {
	env := harness.NewEnv(t)
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	_, brokerAddr := env.StartBrokerProcess()
	env.StartAgentProcess(brokerAddr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: cluster, Namespace: "default", Name: "webhook", Ports: map[string]string{"443": wh.Addr},
	}}})
	svc := harness.WebhookService{Namespace: "default", Name: "webhook", Path: "/admit", Port: 443, CABundle: wh.CABundle}
	adm := harness.NewAdmission(t, harness.AdmissionOptions{Service: svc, Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, env.Dialer(brokerAddr, "/kcp"))})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	for i := range 20 {
		if _, err := adm.Admit(ctx, configMap(nil)); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	if _, err := adm.Admit(ctx, configMap(map[string]string{"deny": "yes"})); err == nil {
		t.Fatal("denied request was admitted")
	}
}

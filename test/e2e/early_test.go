package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// kcpplugin's EarlyData, on the real binaries and k8s.io/apiserver's webhook
// client: the ClientHello goes with the dial, TLS (caBundle, ServerName)
// still runs end to end, and a dial that fails reaches the admission error
// as it does without early data.

func TestWebhookWithEarlyDataAllowsAndDenies(t *testing.T) {
	env := harness.NewEnv(t)
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	dialer, svc := tunnelFor(t, env, wh)
	dialer.EarlyData = true
	adm := harness.NewAdmission(t, harness.AdmissionOptions{Service: svc, Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, dialer)})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	for range 3 { // new connections and kept-alive ones
		if _, err := adm.Admit(ctx, configMap(nil)); err != nil {
			t.Fatalf("allowed request: %v", err)
		}
	}
	_, err := adm.Admit(ctx, configMap(map[string]string{"deny": "yes"}))
	if err == nil || !strings.Contains(err.Error(), "denied through the tunnel") {
		t.Fatalf("denied request: got %v, want the webhook's denial", err)
	}
}

func TestWebhookWithEarlyDataFailsWithTheDialsError(t *testing.T) {
	env := harness.NewEnv(t)
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	dialer, svc := tunnelFor(t, env, wh)
	svc.Name = "missing" // a Service the agent does not know
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	admit := func(early bool) error {
		d := *dialer
		d.EarlyData = early
		adm := harness.NewAdmission(t, harness.AdmissionOptions{Service: svc, Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, &d)})
		_, err := adm.Admit(ctx, configMap(nil))
		if err == nil {
			t.Fatalf("early data %v: a webhook behind a Service the agent does not know allowed the request", early)
		}
		return err
	}
	waited, early := admit(false), admit(true)
	const want = "NotFound"
	for _, err := range []error{waited, early} {
		if !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "missing") {
			t.Errorf("admission error %q, want the dial's %s naming the Service", err, want)
		}
	}
	t.Logf("without early data: %v", waited)
	t.Logf("with early data: %v", early)
}

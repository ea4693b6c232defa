// Command demo runs the tunnel end to end on loopback: a throwaway SPIFFE
// trust domain, the broker and syncer-agent binaries, a TLS admission webhook
// that only the agent can reach, and k8s.io/apiserver's real webhook client
// wired to the broker with kcpplugin. It prints what happens and exits 0 when
// the admission requests went through the tunnel as expected.
package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

const cluster = "root"

func main() {
	// The admission plugin logs each denial as a warning; the demo says it itself.
	klog.LogToStderr(false)
	klog.SetOutput(io.Discard)
	m := &harness.Main{}
	defer m.Close()

	step("dev trust domain spiffe://%s (throwaway, for this demo only)", harness.TrustDomain)
	env := harness.NewEnv(m)

	wh := harness.StartWebhook(m, harness.WebhookOptions{Namespace: "default", Name: "webhook"}, review)
	step("webhook server for Service default/webhook on %s, certificate for webhook.default.svc from its own CA (the caBundle)", wh.Addr)

	_, brokerAddr := env.StartBrokerProcess()
	step("broker serving on %s as %s", brokerAddr, harness.ID("/broker"))

	services := lookup.StaticFile{Services: []lookup.StaticService{{
		Cluster: cluster, Namespace: "default", Name: "webhook", Ports: map[string]string{"443": wh.Addr},
	}}}
	env.StartAgentProcess(brokerAddr, "/agent/sync-target-1", services)
	step("syncer-agent registered as %s, serving logical cluster %q: default/webhook:443 -> %s",
		harness.ID("/agent/sync-target-1"), cluster, wh.Addr)

	svc := harness.WebhookService{Namespace: "default", Name: "webhook", Path: "/admit", Port: 443, CABundle: wh.CABundle}
	adm := harness.NewAdmission(m, harness.AdmissionOptions{
		Service: svc,
		Wrapper: kcpplugin.AuthInfoResolverWrapper(cluster, env.Dialer(brokerAddr, "/kcp")),
	})
	step("kcp's webhook client (k8s.io/apiserver ValidatingAdmissionWebhook) dials through the broker as %s", harness.ID("/kcp"))

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ok := true
	for _, c := range []struct {
		name  string
		data  map[string]string
		allow bool
	}{
		{"allowed", map[string]string{"color": "green"}, true},
		{"denied", map[string]string{"color": "red"}, false},
	} {
		start := time.Now()
		_, err := adm.Admit(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: c.name}, Data: c.data})
		took := time.Since(start).Round(time.Microsecond)
		switch {
		case err == nil && c.allow:
			step("CREATE configmaps default/%s: allowed by the webhook through the tunnel (%v)", c.name, took)
		case err != nil && !c.allow && strings.Contains(err.Error(), "red is not allowed"):
			step("CREATE configmaps default/%s: denied by the webhook through the tunnel: %v (%v)", c.name, err, took)
		default:
			ok = false
			step("CREATE configmaps default/%s: unexpected result: %v", c.name, err)
		}
	}
	if !ok {
		m.Fatal("the demo did not go as expected")
	}
	step("done: TLS ran end to end from kcp's webhook client to the webhook, through broker and agent")
}

// review denies red ConfigMaps.
func review(req *admissionv1.AdmissionRequest, _ string) *admissionv1.AdmissionResponse {
	if strings.Contains(string(req.Object.Raw), `"color":"red"`) {
		return &admissionv1.AdmissionResponse{Allowed: false, Result: &metav1.Status{Message: "red is not allowed", Code: 403}}
	}
	return &admissionv1.AdmissionResponse{Allowed: true}
}

func step(format string, args ...any) {
	fmt.Printf("==> "+format+"\n", args...)
}

package spire

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// kcp as an operator runs it (deploy/kcp) takes its SVID from SPIRE's
// Workload API (--tunnel-spiffe-socket): its validating webhook, a Service
// of logical cluster root that the agent serves, is called through the
// broker; and again once the SVID kcp started with has expired and SPIRE
// has rotated it (the broker refuses expired SVIDs).
func TestSPIREKcpTakesItsSVIDFromTheWorkloadAPI(t *testing.T) {
	bin, err := harness.KCPBinary()
	if err != nil {
		t.Fatal(err)
	}
	r := startSPIRERun(t)
	r.startWorkloads(t)
	// kcp runs as uid 0, as this process: its SVID is kcpID, and this
	// process's source sees the one the SPIRE agent hands kcp.
	first := mustSVID(t, r.caller).Certificates[0]

	dir := t.TempDir()
	port := harness.FreePort(t)
	kcp, err := harness.StartDaemon(bin, filepath.Join(dir, "kcp.log"), nil,
		"start", "--root-directory", filepath.Join(dir, "kcp"), "--bind-address", "127.0.0.1", "--secure-port", strconv.Itoa(port),
		"--embedded-etcd-client-port", strconv.Itoa(harness.FreePort(t)), "--embedded-etcd-peer-port", strconv.Itoa(harness.FreePort(t)),
		"--tunnel-broker", r.brokerAddr, "--tunnel-broker-spiffe-id", brokerID.String(), "--tunnel-spiffe-socket", r.s.WorkloadAPI)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("---- kcp (last lines) ----\n%s", kcp.LogTail())
		}
		_ = kcp.Stop()
	})
	var kube kubernetes.Interface
	if err := kcp.WaitReady("kcp", 5*time.Minute, func(ctx context.Context) error {
		cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(dir, "kcp", "admin.kubeconfig"))
		if err != nil {
			return err
		}
		cfg.Host = "https://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) + "/clusters/root"
		if kube, err = kubernetes.NewForConfig(cfg); err != nil {
			return err
		}
		// Ready to take objects in root's namespace default.
		_, err = kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "default"}}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			err = nil
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(kcp.Log(), "calling webhook Services through the tunnel broker") || !strings.Contains(kcp.Log(), kcpID.String()) {
		t.Fatalf("kcp does not say it calls webhooks through the broker as %s", kcpID)
	}

	ctx := context.Background()
	path, port443 := "/admit", int32(443)
	fail, none, timeout := admissionregistrationv1.Fail, admissionregistrationv1.SideEffectClassNone, int32(10)
	if _, err := kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Create(ctx, &admissionregistrationv1.ValidatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "spire"},
		Webhooks: []admissionregistrationv1.ValidatingWebhook{{
			Name: "validate.spire.test",
			ClientConfig: admissionregistrationv1.WebhookClientConfig{
				Service:  &admissionregistrationv1.ServiceReference{Namespace: "default", Name: "webhook", Path: &path, Port: &port443},
				CABundle: r.wh.CABundle,
			},
			Rules: []admissionregistrationv1.RuleWithOperations{{
				Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
				Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"configmaps"}},
			}},
			ObjectSelector: &metav1.LabelSelector{MatchLabels: map[string]string{"deny": "yes"}},
			FailurePolicy:  &fail, SideEffects: &none, TimeoutSeconds: &timeout, AdmissionReviewVersions: []string{"v1"},
		}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	n := 0
	refused := func(what string) {
		t.Helper()
		harness.Eventually(t, time.Minute, "kcp's webhook, through the tunnel, to refuse a ConfigMap "+what, func() bool {
			n++
			_, err := kube.CoreV1().ConfigMaps("default").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{
				Name: fmt.Sprintf("probe-%d", n), Labels: map[string]string{"deny": "yes"},
			}}, metav1.CreateOptions{})
			return err != nil && strings.Contains(err.Error(), "denied through the tunnel")
		})
	}
	refused("with kcp's first SVID")

	// SPIRE rotates kcp's SVID at half its life; once the first has
	// expired, no connection can present it.
	if wait := time.Until(first.NotAfter) + time.Second; wait > 0 {
		time.Sleep(wait)
	}
	if now := mustSVID(t, r.caller).Certificates[0]; now.SerialNumber.Cmp(first.SerialNumber) == 0 {
		t.Fatalf("SPIRE did not rotate kcp's SVID (serial %s)", first.SerialNumber)
	}
	refused("after kcp's first SVID expired")
	t.Logf("kcp called its webhook through the broker with SVID serial %s, and after it expired (%s) with SPIRE's next", first.SerialNumber, first.NotAfter.Format(time.TimeOnly))
}

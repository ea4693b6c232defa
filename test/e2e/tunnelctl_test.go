package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admission/v1"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// tunnelctl runs the built CLI with the operator's (or another) identity.
func tunnelctl(t *testing.T, env *harness.Env, broker, identity string, args ...string) *exec.Cmd {
	f := env.SVID(identity)
	base := []string{"--broker", broker, "--svid-cert", f.Cert, "--svid-key", f.Key, "--trust-bundle", f.Bundle}
	return exec.Command(filepath.Join(harness.Binaries(t), "tunnelctl"), append(base, args...)...)
}

func TestPortForwardCarriesHTTPSToWebhook(t *testing.T) {
	env := harness.NewEnv(t)
	wh := harness.StartWebhook(t, harness.WebhookOptions{Namespace: "default", Name: "webhook"},
		func(*admissionv1.AdmissionRequest, string) *admissionv1.AdmissionResponse {
			return &admissionv1.AdmissionResponse{Allowed: true}
		})
	b := env.StartBroker(harness.BrokerOptions{})
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "webhook", Ports: map[string]string{"443": wh.Addr}},
	}})
	local := freeAddr(t, "127.0.0.1")
	_, port, _ := net.SplitHostPort(local)

	cmd := tunnelctl(t, env, b.Addr, "/kcp", "port-forward", port, "root/default/webhook:443")
	stderr, _ := cmd.StderrPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	lines := bufio.NewScanner(stderr)
	if !lines.Scan() || !strings.Contains(lines.Text(), "Forwarding from") {
		t.Fatalf("port-forward did not start: %q", lines.Text())
	}
	go io.Copy(io.Discard, stderr)

	// As curl --cacert ca.crt --connect-to webhook.default.svc:443:127.0.0.1:PORT would.
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(wh.CABundle)
	client := &http.Client{Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots, ServerName: "webhook.default.svc"},
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "tcp", local)
		},
	}}
	defer client.CloseIdleConnections()
	review := `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"42","object":{}}}`
	for i := range 3 {
		resp, err := client.Post("https://webhook.default.svc/admit", "application/json", strings.NewReader(review))
		if err != nil {
			t.Fatalf("request %d through port-forward: %v", i, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"allowed":true`) || !strings.Contains(string(body), `"uid":"42"`) {
			t.Fatalf("request %d: %s %s", i, resp.Status, body)
		}
	}
}

func TestPortForwardTunnelctlDialAndAgents(t *testing.T) {
	env := harness.NewEnv(t)
	b := env.StartBroker(harness.BrokerOptions{})
	echo := harness.StartEcho(t)
	env.StartAgent(b.Addr, "/agent/sync-target-1", lookup.StaticFile{Services: []lookup.StaticService{
		{Cluster: "root", Namespace: "default", Name: "echo", Ports: map[string]string{"80": echo}},
	}})

	// dial is nc: stdin goes through, its end half-closes, the echo comes back.
	cmd := tunnelctl(t, env, b.Addr, "/kcp", "dial", "root", "default", "echo", "80")
	cmd.Stdin = strings.NewReader("hello through the tunnel\n")
	out, err := cmd.Output()
	if err != nil || string(out) != "hello through the tunnel\n" {
		t.Fatalf("tunnelctl dial: %q, %v", out, err)
	}

	// Each failure says what it is and what to do.
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"dial", "nowhere", "default", "echo", "80"}, []string{"Unavailable", `no agent serves logical cluster "nowhere"`, "is its syncer agent running and registered (tunnelctl agents)?"}},
		{[]string{"dial", "root", "default", "nope", "80"}, []string{"NotFound", "no service default/nope"}},
		{[]string{"dial", "Root", "default", "echo", "80"}, []string{"InvalidArgument", "not a valid logical cluster name"}},
		{[]string{"port-forward", "0", "root/default"}, []string{"want CLUSTER/NAMESPACE/SERVICE:PORT"}},
	} {
		out, err := tunnelctl(t, env, b.Addr, "/kcp", tc.args...).CombinedOutput()
		if err == nil {
			t.Errorf("tunnelctl %v succeeded", tc.args)
		}
		for _, w := range tc.want {
			if !bytes.Contains(out, []byte(w)) {
				t.Errorf("tunnelctl %v: %q does not say %q", tc.args, out, w)
			}
		}
	}
	out, err = tunnelctl(t, env, b.Addr, "/stranger", "dial", "root", "default", "echo", "80").CombinedOutput()
	if err == nil || !bytes.Contains(out, []byte("PermissionDenied")) || !bytes.Contains(out, []byte("policy")) {
		t.Errorf("tunnelctl as a stranger: %q", out)
	}

	// agents lists the agent with its cluster, for an operator only.
	var listing []byte
	harness.Eventually(t, 10*time.Second, "the agent listing", func() bool {
		listing, err = tunnelctl(t, env, b.Addr, "/operator", "agents").CombinedOutput()
		return err == nil
	})
	for _, w := range []string{"broker replica broker-0: 1 agent\n", "sync-target-1", harness.ID("/agent/sync-target-1").String(), "root", "serving"} {
		if !bytes.Contains(listing, []byte(w)) {
			t.Errorf("agents listing lacks %q:\n%s", w, listing)
		}
	}
	out, err = tunnelctl(t, env, b.Addr, "/kcp", "agents").CombinedOutput()
	if err == nil || !bytes.Contains(out, []byte("PermissionDenied")) {
		t.Errorf("a caller listed agents: %q, %v", out, err)
	}
}

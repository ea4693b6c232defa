package main

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The webhook runs in a process of its own, as a webhook pod would (see
// startChild), with its serving certificate and key in these files.
const (
	certEnv = "TUNNELBENCH_WEBHOOK_CERT"
	keyEnv  = "TUNNELBENCH_WEBHOOK_KEY"
)

// webhookServer is the child process serving the admission webhook.
type webhookServer struct {
	Addr     string
	CABundle []byte
}

// startWebhookProcess issues a serving certificate for the webhook's Service
// name from a CA of its own (the caBundle), starts the child and waits for
// its address.
func startWebhookProcess(m *harness.Main) *webhookServer {
	ca, err := devca.New("webhook CA", "")
	if err != nil {
		m.Fatal(err)
	}
	leaf, err := ca.Issue(devca.Leaf{
		CommonName: svcWebhook + "." + namespace + ".svc",
		DNSNames:   []string{svcWebhook + "." + namespace + ".svc"},
	})
	if err != nil {
		m.Fatal(err)
	}
	dir := m.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	if err := os.WriteFile(certFile, leaf.CertPEM, 0o600); err != nil {
		m.Fatal(err)
	}
	if err := os.WriteFile(keyFile, leaf.KeyPEM, 0o600); err != nil {
		m.Fatal(err)
	}
	addr, _ := startChild(m, "webhook", certEnv+"="+certFile, keyEnv+"="+keyFile)
	return &webhookServer{Addr: addr, CABundle: ca.BundlePEM()}
}

// serveWebhook is the child's main: the harness's AdmissionHandler, which
// decodes each AdmissionReview and answers allowed, over TLS with HTTP/1.1
// keep-alive, on a loopback port it prints; until stdin closes.
func serveWebhook() {
	cert, err := tls.LoadX509KeyPair(os.Getenv(certEnv), os.Getenv(keyEnv))
	if err != nil {
		fatalf("webhook: %v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fatalf("webhook: %v", err)
	}
	srv := &http.Server{
		Handler:   harness.AdmissionHandler(allow),
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12},
	}
	go func() { _ = srv.ServeTLS(l, "", "") }()
	fmt.Printf("listening %s\n", l.Addr())
	_, _ = io.Copy(io.Discard, os.Stdin)
	srv.Close()
}

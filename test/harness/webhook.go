package harness

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"sync/atomic"

	admissionv1 "k8s.io/api/admission/v1"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

// Webhook is an HTTPS admission webhook server on loopback, with a
// certificate for its Service name (name.namespace.svc) from its own CA.
type Webhook struct {
	Addr string
	// CABundle is the webhook configuration's caBundle.
	CABundle []byte

	accepted, open atomic.Int64
}

// Connections is how many connections the webhook accepted since it
// started, and how many of them are open now.
func (w *Webhook) Connections() (accepted, open int64) {
	return w.accepted.Load(), w.open.Load()
}

// WebhookOptions describe a webhook server.
type WebhookOptions struct {
	Namespace, Name string
	// ClientCA, if set, makes the server require a client certificate
	// signed by it.
	ClientCA *devca.CA
	// Listen is the address to serve on; default 127.0.0.1:0.
	Listen string
	// CA issues the server's certificate; default a CA of its own.
	CA *devca.CA
	// IPs are more names of the certificate, for a webhook called by URL.
	IPs []net.IP
}

// StartWebhook serves review on a loopback port until the test ends. The
// review function sees the request and, for a required client certificate,
// the peer's common name.
func StartWebhook(t T, opts WebhookOptions, review func(req *admissionv1.AdmissionRequest, clientCN string) *admissionv1.AdmissionResponse) *Webhook {
	t.Helper()
	return StartTLSWebhook(t, opts, AdmissionHandler(review))
}

// StartTLSWebhook serves handler over TLS, with a certificate for the
// Service name from opts.CA or a CA of its own, on a loopback port until the
// test ends.
func StartTLSWebhook(t T, opts WebhookOptions, handler http.Handler) *Webhook {
	t.Helper()
	ca := opts.CA
	if ca == nil {
		var err error
		if ca, err = devca.New("webhook CA", ""); err != nil {
			t.Fatal(err)
		}
	}
	leaf, err := ca.Issue(devca.Leaf{
		CommonName: opts.Name + "." + opts.Namespace + ".svc",
		DNSNames:   []string{opts.Name + "." + opts.Namespace + ".svc"},
		IPs:        opts.IPs,
	})
	if err != nil {
		t.Fatal(err)
	}
	cert, err := tls.X509KeyPair(leaf.CertPEM, leaf.KeyPEM)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}
	if opts.ClientCA != nil {
		pool := x509.NewCertPool()
		pool.AddCert(opts.ClientCA.Cert)
		cfg.ClientCAs = pool
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	}
	if opts.Listen == "" {
		opts.Listen = "127.0.0.1:0"
	}
	l, err := net.Listen("tcp", opts.Listen)
	if err != nil {
		t.Fatal(err)
	}
	w := &Webhook{Addr: l.Addr().String(), CABundle: ca.BundlePEM()}
	srv := &http.Server{Handler: handler, TLSConfig: cfg, ConnState: func(_ net.Conn, state http.ConnState) {
		switch state {
		case http.StateNew:
			w.accepted.Add(1)
			w.open.Add(1)
		case http.StateClosed, http.StateHijacked:
			w.open.Add(-1)
		}
	}}
	go func() { _ = srv.ServeTLS(l, "", "") }()
	t.Cleanup(func() { srv.Close() })
	return w
}

// AdmissionHandler decodes AdmissionReviews and answers with review's
// response.
func AdmissionHandler(review func(req *admissionv1.AdmissionRequest, clientCN string) *admissionv1.AdmissionResponse) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in admissionv1.AdmissionReview
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Request == nil {
			http.Error(w, "not an AdmissionReview", http.StatusBadRequest)
			return
		}
		cn := ""
		if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
			cn = r.TLS.PeerCertificates[0].Subject.CommonName
		}
		resp := review(in.Request, cn)
		resp.UID = in.Request.UID
		out := admissionv1.AdmissionReview{TypeMeta: in.TypeMeta, Response: resp}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(&out)
	})
}

// StartEcho serves TCP echo on loopback until the test ends.
func StartEcho(t T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	t.Cleanup(func() { l.Close(); <-done })
	return l.Addr().String()
}

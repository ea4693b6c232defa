package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// reviewSize is the AdmissionReview's size, about that of a review of a
// small object.
const reviewSize = 4 << 10

// maxRequests bounds one worker's requests, whatever the duration.
const maxRequests = 1_000_000

// allow is the webhook's review: everything is allowed.
func allow(*admissionv1.AdmissionRequest, string) *admissionv1.AdmissionResponse {
	return &admissionv1.AdmissionResponse{Allowed: true}
}

// webhookRate POSTs AdmissionReviews of about 4 KiB over kept-alive HTTPS
// (HTTP/1.1, TLS verified against the webhook's caBundle and its Service
// name) to the same webhook server, directly, through the tunnel and
// through the peer when it runs. First on one connection, one request after
// another, for latency; then on cfg.webhookConns connections at once, for
// the rate. Then each request on a new connection (webhookFirstRequest).
func (r *runner) webhookRate(ctx context.Context) {
	body := admissionReview()
	r.logf("AdmissionReview of %d bytes", len(body))
	type result struct {
		seq, conc bench.Samples
		seqRate   float64
		concRate  float64
	}
	res := map[string]result{}
	paths := r.withPeer()
	if c, ok := r.main.connect(); ok {
		paths = append(paths, c)
	}
	for _, p := range paths {
		var out result
		var err error
		client := r.webhookClient(p, 1)
		if out.seq, out.seqRate, err = r.post(ctx, client, body, 1); err != nil {
			r.m.Fatalf("%s webhook: %v", p.name, err)
		}
		client.CloseIdleConnections()
		client = r.webhookClient(p, r.cfg.webhookConns)
		if out.conc, out.concRate, err = r.post(ctx, client, body, r.cfg.webhookConns); err != nil {
			r.m.Fatalf("%s webhook: %v", p.name, err)
		}
		client.CloseIdleConnections()
		res[p.name] = out
		r.logf("%s: %d requests on 1 connection, %d on %d", p.name, len(out.seq), len(out.conc), r.cfg.webhookConns)
	}
	d, t := res["direct"], res["tunneled"]
	r.report.row("webhook_1conn_p50_us", bench.Micros(d.seq.Quantile(0.5)), bench.Micros(t.seq.Quantile(0.5)))
	r.report.row("webhook_1conn_p99_us", bench.Micros(d.seq.Quantile(0.99)), bench.Micros(t.seq.Quantile(0.99)))
	r.report.row("webhook_1conn_per_s", d.seqRate, t.seqRate)
	n := strconv.Itoa(r.cfg.webhookConns)
	r.report.row("webhook_"+n+"conns_per_s", d.concRate, t.concRate)
	r.report.row("webhook_"+n+"conns_p50_us", bench.Micros(d.conc.Quantile(0.5)), bench.Micros(t.conc.Quantile(0.5)))
	r.report.row("webhook_"+n+"conns_p99_us", bench.Micros(d.conc.Quantile(0.99)), bench.Micros(t.conc.Quantile(0.99)))
	if r.peer != nil {
		pr := res[peerName]
		r.report.floorRow(peerName, "webhook_1conn_p50_us", bench.Micros(d.seq.Quantile(0.5)), bench.Micros(pr.seq.Quantile(0.5)))
		r.report.floorRow(peerName, "webhook_1conn_p99_us", bench.Micros(d.seq.Quantile(0.99)), bench.Micros(pr.seq.Quantile(0.99)))
		r.report.floorRow(peerName, "webhook_1conn_per_s", d.seqRate, pr.seqRate)
		r.report.floorRow(peerName, "webhook_"+n+"conns_per_s", d.concRate, pr.concRate)
		r.report.floorRow(peerName, "webhook_"+n+"conns_p50_us", bench.Micros(d.conc.Quantile(0.5)), bench.Micros(pr.conc.Quantile(0.5)))
		r.report.floorRow(peerName, "webhook_"+n+"conns_p99_us", bench.Micros(d.conc.Quantile(0.99)), bench.Micros(pr.conc.Quantile(0.99)))
	}
	if c, ok := res[connectName]; ok {
		// The CONNECT front end (kube-apiserver's egress selector) in the
		// tunneled= column; the Dial path's figures are the rows above.
		r.report.row("connect_webhook_1conn_per_s", d.seqRate, c.seqRate)
		r.report.row("connect_webhook_"+n+"conns_per_s", d.concRate, c.concRate)
		r.report.row("connect_webhook_1conn_p50_us", bench.Micros(d.seq.Quantile(0.5)), bench.Micros(c.seq.Quantile(0.5)))
	}
	r.webhookFirstRequest(ctx, body)
}

// webhookFirstRequest times what a webhook call on a new connection costs:
// the dial, the TLS handshake with the webhook (verified as above) and one
// AdmissionReview POSTed and answered, on every path, cfg.dials times each,
// alternating the paths (inTurn) so that load hits all alike. Each connection is
// closed after its request. TLS sessions are not resumed (Go's client keeps
// no session cache unless told to, nor does kcp's).
func (r *runner) webhookFirstRequest(ctx context.Context, body []byte) {
	paths := r.newConnectionPaths()
	clients := make([]*http.Client, len(paths))
	for i, p := range paths {
		clients[i] = r.webhookClient(p, 1)
		clients[i].Transport.(*http.Transport).DisableKeepAlives = true
	}
	samples := map[string]bench.Samples{}
	failed := 0 // the peer's
	deadline := time.Now().Add(time.Duration(r.cfg.dials) * 50 * time.Millisecond)
	for i := 0; i < r.cfg.dials && time.Now().Before(deadline); i++ {
		for k := range paths {
			j := inTurn(i, k, len(paths))
			p := paths[j]
			start := time.Now()
			if err := r.postOnce(ctx, clients[j], body); err != nil {
				r.newConnectionFailed(p, fmt.Errorf("webhook on a new connection: %w", err))
				failed++
				continue
			}
			samples[p.name] = append(samples[p.name], time.Since(start))
		}
	}
	for _, p := range paths {
		r.logf("%s: %d webhook requests on new connections", p.name, len(samples[p.name]))
	}
	us := func(s bench.Samples, q float64) float64 { return bench.Micros(s.Quantile(q)) }
	const name = "webhook_dial_tls_first_request_"
	d, t := samples["direct"], samples["tunneled"]
	r.report.row(name+"p50_us", us(d, 0.5), us(t, 0.5))
	r.report.row(name+"p99_us", us(d, 0.99), us(t, 0.99))
	e := samples[earlyName]
	r.report.floorRow(earlyName, name+"p50_us", us(d, 0.5), us(e, 0.5))
	r.report.floorRow(earlyName, name+"p99_us", us(d, 0.99), us(e, 0.99))
	if r.relay != nil {
		rl := samples["relay"]
		r.report.relayRow(name+"p50_us", us(d, 0.5), us(rl, 0.5))
		r.report.relayRow(name+"p99_us", us(d, 0.99), us(rl, 0.99))
	}
	if r.peer != nil {
		pr := samples[peerName]
		r.report.floorRow(peerName, name+"p50_us", us(d, 0.5), us(pr, 0.5))
		r.report.floorRow(peerName, name+"p99_us", us(d, 0.99), us(pr, 0.99))
		r.report.floorRow(peerName, name+"failed", none, float64(failed))
	}
}

// webhookClient is an HTTPS client for the webhook over path p, keeping up
// to conns connections alive, as kcp's webhook client would.
func (r *runner) webhookClient(p path, conns int) *http.Client {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(r.webhook.CABundle) {
		r.m.Fatal("webhook caBundle holds no certificate")
	}
	return &http.Client{
		Timeout: 30 * time.Second,
		Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				return p.dial(ctx, svcWebhook)
			},
			TLSClientConfig:     &tls.Config{RootCAs: roots, ServerName: svcWebhook + "." + namespace + ".svc", MinVersion: tls.VersionTLS12},
			MaxIdleConnsPerHost: conns,
			MaxConnsPerHost:     conns,
			DisableCompression:  true,
		},
	}
}

// post runs workers that POST body one request after another for
// cfg.duration, after one warm-up request each (the TLS handshake), and
// returns the latencies and the rate.
func (r *runner) post(ctx context.Context, client *http.Client, body []byte, workers int) (bench.Samples, float64, error) {
	do := func() error { return r.postOnce(ctx, client, body) }
	// Open every connection before the clock starts.
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Go(func() {
			if err := do(); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	select {
	case err := <-errs:
		return nil, 0, err
	default:
	}

	var mu sync.Mutex
	var all bench.Samples
	start := time.Now()
	end := start.Add(r.cfg.duration)
	for range workers {
		wg.Go(func() {
			s := make(bench.Samples, 0, 1<<12)
			for len(s) < maxRequests && time.Now().Before(end) {
				t0 := time.Now()
				if err := do(); err != nil {
					errs <- err
					return
				}
				s = append(s, time.Since(t0))
			}
			mu.Lock()
			all = append(all, s...)
			mu.Unlock()
		})
	}
	wg.Wait()
	took := time.Since(start)
	select {
	case err := <-errs:
		return nil, 0, err
	default:
	}
	return all, float64(len(all)) / took.Seconds(), nil
}

// postOnce POSTs body to the webhook with client and checks that it was
// allowed.
func (r *runner) postOnce(ctx context.Context, client *http.Client, body []byte) error {
	url := "https://" + svcWebhook + "." + namespace + ".svc/admit"
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || !bytes.Contains(out, []byte(`"allowed":true`)) {
		return fmt.Errorf("webhook answered %s: %.200s", resp.Status, out)
	}
	return nil
}

// admissionReview is an AdmissionReview of a ConfigMap CREATE, padded with
// data to about reviewSize bytes of JSON.
func admissionReview() []byte {
	build := func(pad int) []byte {
		cm := corev1.ConfigMap{
			TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
			ObjectMeta: metav1.ObjectMeta{Name: "bench", Namespace: "default", Labels: map[string]string{"app": "bench"}},
			Data:       map[string]string{"payload": strings.Repeat("x", pad)},
		}
		raw, err := json.Marshal(&cm)
		if err != nil {
			panic(err)
		}
		review := admissionv1.AdmissionReview{
			TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
			Request: &admissionv1.AdmissionRequest{
				UID:       types.UID("705ab4f5-6393-11e8-b7cc-42010a800002"),
				Kind:      metav1.GroupVersionKind{Version: "v1", Kind: "ConfigMap"},
				Resource:  metav1.GroupVersionResource{Version: "v1", Resource: "configmaps"},
				Name:      "bench",
				Namespace: "default",
				Operation: admissionv1.Create,
				UserInfo:  authenticationv1.UserInfo{Username: "admin", Groups: []string{"system:masters", "system:authenticated"}},
				Object:    runtime.RawExtension{Raw: raw},
			},
		}
		out, err := json.Marshal(&review)
		if err != nil {
			panic(err)
		}
		return out
	}
	base := len(build(0))
	return build(max(0, reviewSize-base))
}

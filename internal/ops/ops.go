// Package ops serves what operators and Kubernetes probe over plain HTTP,
// apart from the gRPC port: Prometheus metrics, liveness and readiness, and
// optionally pprof on a separate (loopback) address.
package ops

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Options say what to serve where.
type Options struct {
	// Listen serves /metrics, /healthz and /readyz; empty: not served.
	// Both binaries take it as --metrics-listen, which its errors name.
	Listen string
	// Pprof serves /debug/pprof; empty: not served. Its errors name
	// --pprof-listen.
	Pprof string
	// Ready answers /readyz: nil when the process can do its job, else
	// why not, which /readyz's body says.
	Ready   func() error
	Metrics *prometheus.Registry
}

// Serve starts the listeners and serves until ctx ends. It returns once the
// listeners are bound, so a bad address fails the start. Give it a ctx that
// ends when the process exits, not at SIGTERM: probes and metrics go on
// answering during the drain (/readyz with 503).
func Serve(ctx context.Context, o Options, log *slog.Logger) error {
	if o.Listen != "" {
		o.Metrics.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(o.Metrics, promhttp.HandlerOpts{Registry: o.Metrics}))
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
		mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
			if o.Ready != nil {
				if err := o.Ready(); err != nil {
					http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
					return
				}
			}
			_, _ = w.Write([]byte("ok\n"))
		})
		if err := serve(ctx, o.Listen, mux, log); err != nil {
			return fmt.Errorf("--metrics-listen: %w", err)
		}
	}
	if o.Pprof != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		if err := serve(ctx, o.Pprof, mux, log); err != nil {
			return fmt.Errorf("--pprof-listen: %w", err)
		}
	}
	return nil
}

func serve(ctx context.Context, addr string, h http.Handler, log *slog.Logger) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("HTTP endpoint failed", "address", addr, "error", err)
		}
	}()
	context.AfterFunc(ctx, func() { _ = srv.Close() })
	log.Info("HTTP endpoint serving", "address", l.Addr().String())
	return nil
}

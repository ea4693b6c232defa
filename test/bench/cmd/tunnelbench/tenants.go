package main

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// The hanging tenant: a logical cluster of its own, served by the same
// agent as cluster, whose one Service's connects never complete.
const (
	hangingCluster = "tenant-hanging"
	svcHanging     = "hanging"
)

// hangingDials is how many dials at a time wait on the hanging tenant's
// Service: more than the broker's default --max-pending-dials-per-cluster
// (256), so that its queue stays full and it is refused the rest.
const hangingDials = 256 + 32

// hangingDialTimeout bounds a direct dial to the hanging Service, as the
// broker's default --dial-timeout bounds a tunneled one.
const hangingDialTimeout = 5 * time.Second

// refusedWait is how long a hanging dial that the broker refused at once
// waits before it dials again, as a webhook client's next call would.
const refusedWait = 200 * time.Millisecond

// tenants times dials to a healthy Service of cluster, one after another,
// first alone, then while hangingDials dials at a time wait on the hanging
// tenant's Service through the same broker and agent (each dialing again
// when it fails: about 50 dials/s that time out, plus those refused at
// once), for at least one whole round of hanging dials timing out. It
// reports the healthy dials' p50 and p99 both ways and how many of them
// failed under load, and how many hanging dials the broker refused.
// Directly, the hanging dials are connects to the same hanging address.
func (r *runner) tenants(ctx context.Context) {
	type result struct {
		alone, loaded bench.Samples
		failed        int
		refused       int64
	}
	res := map[string]result{}
	for _, p := range r.paths() {
		var out result
		out.alone, _ = r.timeDials(ctx, p, r.cfg.dials/2, 0)

		loadCtx, stopLoad := context.WithCancel(ctx)
		var refused, started atomic.Int64
		var load sync.WaitGroup
		for range hangingDials {
			load.Go(func() {
				started.Add(1)
				for loadCtx.Err() == nil {
					err := r.dialHanging(loadCtx, p)
					if status.Code(err) == codes.ResourceExhausted {
						refused.Add(1)
						select {
						case <-time.After(refusedWait):
						case <-loadCtx.Done():
						}
					}
				}
			})
		}
		// Wait until the load is in place: every dial started, and over the
		// tunnel, the hanging tenant's queue full (a dial refused).
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if started.Load() == hangingDials && (p.name == "direct" || refused.Load() > 0) {
				break
			}
		}
		if p.name != "direct" && refused.Load() == 0 {
			r.logf("%s: no hanging dial was refused within 20s: the hanging tenant's queue is not full", p.name)
		}
		var errs []error
		out.loaded, errs = r.timeDials(ctx, p, r.cfg.dials/2, hangingDialTimeout+time.Second)
		out.failed = len(errs)
		stopLoad()
		load.Wait()
		out.refused = refused.Load()
		if len(errs) > 0 {
			r.logf("%s: %d of the healthy tenant's dials failed under load, the first: %v", p.name, len(errs), errs[0])
		}
		r.logf("%s: %d healthy dials alone, %d under load (%d failed); %d hanging dials refused",
			p.name, len(out.alone), len(out.loaded), out.failed, out.refused)
		res[p.name] = out
	}
	d, t := res["direct"], res["tunneled"]
	r.report.row("tenants_dial_alone_p50_us", bench.Micros(d.alone.Quantile(0.5)), bench.Micros(t.alone.Quantile(0.5)))
	r.report.row("tenants_dial_alone_p99_us", bench.Micros(d.alone.Quantile(0.99)), bench.Micros(t.alone.Quantile(0.99)))
	r.report.row("tenants_dial_loaded_p50_us", quantileOrNone(d.loaded, 0.5), quantileOrNone(t.loaded, 0.5))
	r.report.row("tenants_dial_loaded_p99_us", quantileOrNone(d.loaded, 0.99), quantileOrNone(t.loaded, 0.99))
	r.report.row("tenants_dial_loaded_failed", float64(d.failed), float64(t.failed))
	r.report.row("tenants_hanging_dials_refused", none, float64(t.refused))
}

// dialEvery paces the healthy tenant's dials, alone and under load alike,
// as a steady flow of webhook calls: no faster, so that the direct path's
// closed connections do not pile up in TIME_WAIT.
const dialEvery = 5 * time.Millisecond

// timeDials dials the healthy tenant's Service on p, one every dialEvery,
// n times and for at least min (bounded: min and 20s), closing each
// connection, and returns the successful dials' latencies and the failures.
func (r *runner) timeDials(ctx context.Context, p path, n int, min time.Duration) (bench.Samples, []error) {
	var samples bench.Samples
	var errs []error
	start := time.Now()
	deadline := start.Add(max(time.Duration(n)*dialEvery, min) + 20*time.Second)
	for i := 0; (i < n || time.Since(start) < min) && time.Now().Before(deadline); i++ {
		time.Sleep(time.Until(start.Add(time.Duration(i) * dialEvery)))
		dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		began := time.Now()
		c, err := p.dial(dctx, svcTenant)
		took := time.Since(began)
		cancel()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		samples = append(samples, took)
		c.Close()
	}
	return samples, errs
}

// dialHanging dials the hanging tenant's Service on p, and closes what it
// gets (nothing, unless the Service stops hanging).
func (r *runner) dialHanging(ctx context.Context, p path) error {
	var c net.Conn
	var err error
	if p.name == "direct" {
		dctx, cancel := context.WithTimeout(ctx, hangingDialTimeout)
		c, err = (&net.Dialer{}).DialContext(dctx, "tcp", r.hanging)
		cancel()
	} else {
		c, err = r.main.dialer.DialService(ctx, hangingCluster, namespace, svcHanging, portPlain)
	}
	if c != nil {
		c.Close()
		return errors.New("the hanging Service answered")
	}
	return err
}

// quantileOrNone is s's q-quantile in microseconds, or none without samples.
func quantileOrNone(s bench.Samples, q float64) float64 {
	if len(s) == 0 {
		return none
	}
	return bench.Micros(s.Quantile(q))
}

package main

import (
	"context"
	"fmt"
	"net"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// dialLatency times cfg.dials dials per path, one after another, alternating
// the paths (inTurn) so that load on the machine hits all alike; after each dial, one
// 64-byte round trip. A tunneled dial is DialService: the Dial RPC until the
// broker's established, which comes after the agent connected to the
// target, so the stream is usable; there is no TLS inside. A direct dial is
// a TCP connect. Each connection is closed before the next dial.
//
// dial_first_echo_* times the dial and the first round trip together, which
// is what every path can be compared on (early_dial_first_echo_* is the
// tunnel with kcpplugin's EarlyData, whose dial returns at once): a peer's dial may return before
// its far end has connected to the target (remotedialer's does, see
// peer.go), so the peer has only these rows.
//
// A relay dial (when the relay path runs) is more than a tunneled one: the
// tunnel reuses its long-lived gRPC connections, while the relay path makes
// two TCP connections and mTLS handshakes per dial (caller to relay 1, relay
// 1 to relay 2), then relay 2's connect to the target and its answer. So its
// rows say so (relay_dial_2handshakes_*), and relay_handshake_* is the
// caller's TCP connect and handshake to relay 1 alone, from the same dials.
func (r *runner) dialLatency(ctx context.Context) {
	run := dialRun{stem: "dial", rounds: r.cfg.dials}
	s := r.dialLoop(ctx, r.newConnectionPaths(), run)
	r.reportDials(s)
	r.reportFirstEchoes(run.stem, s)
	r.reportDialCPU(run.stem, s)
}

// pacedDials is the dial phase at a webhook client's pace: cfg.pacedDials
// rounds of one dial and first round trip per path, with cfg.pacedPause
// after each, so that every dial finds the processes idle, where
// back-to-back dials keep the processes busy. Its rows are
// paced_dial_first_echo_* and the CPU a dial costs; the relay, whose two
// handshakes a dial are no floor for either case, is left out.
func (r *runner) pacedDials(ctx context.Context) {
	var paths []path
	for _, p := range r.newConnectionPaths() {
		if p.name != "relay" {
			paths = append(paths, p)
		}
	}
	run := dialRun{stem: "paced_dial", rounds: r.cfg.pacedDials, pause: r.cfg.pacedPause}
	s := r.dialLoop(ctx, paths, run)
	r.reportFirstEchoes(run.stem, s)
	r.reportDialCPU(run.stem, s)
}

// dialRun is one loop of new connections: its rounds (a dial per path
// each), the pause after each round, and the stem of its rows and profile.
type dialRun struct {
	stem   string
	rounds int
	pause  time.Duration
}

// dialSamples is what a dial loop measured, by path name.
type dialSamples struct {
	dials, firstEchoes map[string]bench.Samples
	handshakes         bench.Samples // the relay's first handshakes
	failed             int           // the peer's new connections that failed
	cpu                cpuTimes      // over the loop
}

// dialLoop runs run over paths after a warm-up dial of each.
func (r *runner) dialLoop(ctx context.Context, paths []path, run dialRun) dialSamples {
	s := dialSamples{dials: make(map[string]bench.Samples, len(paths)), firstEchoes: make(map[string]bench.Samples, len(paths))}
	// Warm up: the first dial of each path pays for lazy setup.
	for _, p := range paths {
		r.dialOrFatal(ctx, p, svcDial).Close()
	}
	// About a millisecond a dial and path: the profile covers most dials.
	stop := r.profile(ctx, run.stem, time.Duration(run.rounds)*(time.Duration(len(paths))*time.Millisecond+run.pause))
	cpu0 := r.cpu()
	msg, buf := make([]byte, msgSize), make([]byte, msgSize)
	deadline := time.Now().Add(time.Duration(run.rounds) * (50*time.Millisecond + run.pause))
	for i := 0; i < run.rounds && time.Now().Before(deadline); i++ {
		if i > 0 && !sleepCtx(ctx, run.pause) {
			break
		}
		for j := range paths {
			p := paths[inTurn(i, j, len(paths))]
			start := time.Now()
			c, err := r.dialAndEcho(ctx, p, msg, buf)
			if err != nil {
				r.newConnectionFailed(p, err)
				s.failed++
				continue
			}
			s.firstEchoes[p.name] = append(s.firstEchoes[p.name], time.Since(start))
			s.dials[p.name] = append(s.dials[p.name], c.dialed)
			if rc, ok := c.Conn.(*relayConn); ok {
				s.handshakes = append(s.handshakes, rc.handshake)
			}
			c.Close()
		}
	}
	s.cpu = r.cpu().sub(cpu0)
	stop()
	for _, p := range paths {
		r.logf("%s: %d dials", p.name, len(s.dials[p.name]))
	}
	return s
}

// sleepCtx waits d, or until ctx ends; it reports whether d has passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// echoedConn is a new connection after its first round trip, and how long
// its dial took.
type echoedConn struct {
	net.Conn
	dialed time.Duration
}

// dialAndEcho dials the echo service on p and makes one round trip of msg.
func (r *runner) dialAndEcho(ctx context.Context, p path, msg, buf []byte) (echoedConn, error) {
	start := time.Now()
	dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	c, err := p.dial(dctx, svcDial)
	if err != nil {
		return echoedConn{}, fmt.Errorf("dialing %s: %w", svcDial, err)
	}
	dialed := time.Since(start)
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	if err := bench.RoundTrip(c, msg, buf); err != nil {
		c.Close()
		return echoedConn{}, fmt.Errorf("first round trip: %w", err)
	}
	return echoedConn{Conn: c, dialed: dialed}, nil
}

// reportDialCPU prints what a dial, its first round trip and its close
// cost the middle processes, from their CPU over the whole loop: the
// tunnel's over the dials of all its caller legs (the broker and agent
// serve them all), the peer's over its own; the processes of the other
// paths idle meanwhile but for their pings, which a dial's cost
// includes. With the peer, it also prints how many of the peer's new
// connections failed.
func (r *runner) reportDialCPU(stem string, s dialSamples) {
	perDial := func(d time.Duration, n int) float64 {
		if n == 0 {
			return none
		}
		return bench.Micros(d) / float64(n)
	}
	tunnelDials := 0
	for _, name := range []string{"tunneled", earlyName, connectName} {
		tunnelDials += len(s.dials[name])
	}
	m := s.cpu.middleOf("tunneled")
	r.report.row(stem+"_first_echo_middle_cpu_us", none, perDial(m.used[0]+m.used[1], tunnelDials))
	for i, name := range m.names {
		r.report.row(stem+"_first_echo_"+name+"_cpu_us", none, perDial(m.used[i], tunnelDials))
	}
	if r.peer != nil {
		m := s.cpu.middleOf(peerName)
		n := len(s.dials[peerName])
		r.report.floorRow(peerName, stem+"_first_echo_middle_cpu_us", none, perDial(m.used[0]+m.used[1], n))
		for i, name := range m.names {
			r.report.floorRow(peerName, stem+"_first_echo_"+name+"_cpu_us", none, perDial(m.used[i], n))
		}
		r.report.floorRow(peerName, stem+"_first_echo_failed", none, float64(s.failed))
	}
}

// reportDials prints the rows only the back-to-back dial phase has: the
// dials alone, of the tunnel, the relay and the CONNECT front end, against
// the direct path's, and the relay's first echoes.
func (r *runner) reportDials(s dialSamples) {
	us := func(s bench.Samples, q float64) float64 { return bench.Micros(s.Quantile(q)) }
	d, t := s.dials["direct"], s.dials["tunneled"]
	r.report.row("dial_p50_us", us(d, 0.5), us(t, 0.5))
	r.report.row("dial_p99_us", us(d, 0.99), us(t, 0.99))
	de := s.firstEchoes["direct"]
	if r.relay != nil {
		rl, rle := s.dials["relay"], s.firstEchoes["relay"]
		r.report.relayRow("dial_2handshakes_p50_us", us(d, 0.5), us(rl, 0.5))
		r.report.relayRow("dial_2handshakes_p99_us", us(d, 0.99), us(rl, 0.99))
		r.report.relayRow("handshake_p50_us", us(d, 0.5), us(s.handshakes, 0.5))
		r.report.relayRow("handshake_p99_us", us(d, 0.99), us(s.handshakes, 0.99))
		r.report.relayRow("dial_2handshakes_first_echo_p50_us", us(de, 0.5), us(rle, 0.5))
		r.report.relayRow("dial_2handshakes_first_echo_p99_us", us(de, 0.99), us(rle, 0.99))
	}
	if c, ok := s.dials[connectName]; ok {
		// A CONNECT's 200 comes once the tunnel is established, as a Dial's
		// established does.
		r.report.floorRow(connectName, "dial_p50_us", us(d, 0.5), us(c, 0.5))
		r.report.floorRow(connectName, "dial_p99_us", us(d, 0.99), us(c, 0.99))
	}
}

// reportFirstEchoes prints each path's dial and first round trip against
// the direct path's, as stem_first_echo_p50_us and _p99_us.
func (r *runner) reportFirstEchoes(stem string, s dialSamples) {
	us := func(s bench.Samples, q float64) float64 { return bench.Micros(s.Quantile(q)) }
	de := s.firstEchoes["direct"]
	r.report.row(stem+"_first_echo_p50_us", us(de, 0.5), us(s.firstEchoes["tunneled"], 0.5))
	r.report.row(stem+"_first_echo_p99_us", us(de, 0.99), us(s.firstEchoes["tunneled"], 0.99))
	// With early data the dial returns at once: only its first echo says
	// what it costs.
	for _, name := range []string{earlyName, peerName, connectName} {
		if e, ok := s.firstEchoes[name]; ok {
			r.report.floorRow(name, stem+"_first_echo_p50_us", us(de, 0.5), us(e, 0.5))
			r.report.floorRow(name, stem+"_first_echo_p99_us", us(de, 0.99), us(e, 0.99))
		}
	}
}

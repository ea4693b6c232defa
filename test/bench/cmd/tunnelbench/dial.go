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
// a TCP connect. Each connection is closed before the next dial. With
// -dial-pause, each round of dials (one per path) waits that long after
// the last, so that the processes idle and the spares are replaced between
// rounds, as they are between a webhook client's new connections.
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
	paths := r.newConnectionPaths()
	dials := make(map[string]bench.Samples, len(paths))
	firstEchoes := make(map[string]bench.Samples, len(paths))
	var handshakes bench.Samples
	// Warm up: the first dial of each path pays for lazy setup.
	for _, p := range paths {
		r.dialOrFatal(ctx, p, svcDial).Close()
	}
	// About a millisecond a dial and path: the profile covers most dials.
	stop := r.profile(ctx, "dial", time.Duration(r.cfg.dials*len(paths))*time.Millisecond)
	cpu0 := r.cpu()
	msg, buf := make([]byte, msgSize), make([]byte, msgSize)
	failed := 0 // the peer's
	deadline := time.Now().Add(time.Duration(r.cfg.dials) * (50*time.Millisecond + r.cfg.dialPause))
	for i := 0; i < r.cfg.dials && time.Now().Before(deadline); i++ {
		if i > 0 && !sleepCtx(ctx, r.cfg.dialPause) {
			break
		}
		for j := range paths {
			p := paths[inTurn(i, j, len(paths))]
			start := time.Now()
			c, err := r.dialAndEcho(ctx, p, msg, buf)
			if err != nil {
				r.newConnectionFailed(p, err)
				failed++
				continue
			}
			firstEchoes[p.name] = append(firstEchoes[p.name], time.Since(start))
			dials[p.name] = append(dials[p.name], c.dialed)
			if rc, ok := c.Conn.(*relayConn); ok {
				handshakes = append(handshakes, rc.handshake)
			}
			c.Close()
		}
	}
	used := r.cpu().sub(cpu0)
	stop()
	for _, p := range paths {
		r.logf("%s: %d dials", p.name, len(dials[p.name]))
	}
	r.reportDials(dials, firstEchoes, handshakes)
	r.reportDialCPU(used, dials)
	if r.peer != nil {
		r.report.floorRow(peerName, "dial_first_echo_failed", none, float64(failed))
	}
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
// paths idle meanwhile but for their spares and pings, which a dial's
// cost includes.
func (r *runner) reportDialCPU(used cpuTimes, dials map[string]bench.Samples) {
	perDial := func(d time.Duration, n int) float64 {
		if n == 0 {
			return none
		}
		return bench.Micros(d) / float64(n)
	}
	tunnelDials := 0
	for _, name := range []string{"tunneled", earlyName, streamName, connectName} {
		tunnelDials += len(dials[name])
	}
	m := used.middleOf("tunneled")
	r.report.row("dial_first_echo_middle_cpu_us", none, perDial(m.used[0]+m.used[1], tunnelDials))
	for i, name := range m.names {
		r.report.row("dial_first_echo_"+name+"_cpu_us", none, perDial(m.used[i], tunnelDials))
	}
	if r.peer != nil {
		m := used.middleOf(peerName)
		n := len(dials[peerName])
		r.report.floorRow(peerName, "dial_first_echo_middle_cpu_us", none, perDial(m.used[0]+m.used[1], n))
		for i, name := range m.names {
			r.report.floorRow(peerName, "dial_first_echo_"+name+"_cpu_us", none, perDial(m.used[i], n))
		}
	}
}

// reportDials prints the dial phase's rows: each path's dials and first
// echoes against the direct path's.
func (r *runner) reportDials(dials, firstEchoes map[string]bench.Samples, handshakes bench.Samples) {
	us := func(s bench.Samples, q float64) float64 { return bench.Micros(s.Quantile(q)) }
	d, t := dials["direct"], dials["tunneled"]
	r.report.row("dial_p50_us", us(d, 0.5), us(t, 0.5))
	r.report.row("dial_p99_us", us(d, 0.99), us(t, 0.99))
	de, te := firstEchoes["direct"], firstEchoes["tunneled"]
	r.report.row("dial_first_echo_p50_us", us(de, 0.5), us(te, 0.5))
	r.report.row("dial_first_echo_p99_us", us(de, 0.99), us(te, 0.99))
	// With early data the dial returns at once: only its first echo says
	// what it costs.
	ee := firstEchoes[earlyName]
	r.report.floorRow(earlyName, "dial_first_echo_p50_us", us(de, 0.5), us(ee, 0.5))
	r.report.floorRow(earlyName, "dial_first_echo_p99_us", us(de, 0.99), us(ee, 0.99))
	if r.relay != nil {
		rl, rle := dials["relay"], firstEchoes["relay"]
		r.report.relayRow("dial_2handshakes_p50_us", us(d, 0.5), us(rl, 0.5))
		r.report.relayRow("dial_2handshakes_p99_us", us(d, 0.99), us(rl, 0.99))
		r.report.relayRow("handshake_p50_us", us(d, 0.5), us(handshakes, 0.5))
		r.report.relayRow("handshake_p99_us", us(d, 0.99), us(handshakes, 0.99))
		r.report.relayRow("dial_2handshakes_first_echo_p50_us", us(de, 0.5), us(rle, 0.5))
		r.report.relayRow("dial_2handshakes_first_echo_p99_us", us(de, 0.99), us(rle, 0.99))
	}
	if r.peer != nil {
		pe := firstEchoes[peerName]
		r.report.floorRow(peerName, "dial_first_echo_p50_us", us(de, 0.5), us(pe, 0.5))
		r.report.floorRow(peerName, "dial_first_echo_p99_us", us(de, 0.99), us(pe, 0.99))
	}
	if se, ok := firstEchoes[streamName]; ok {
		r.report.floorRow(streamName, "dial_first_echo_p50_us", us(de, 0.5), us(se, 0.5))
		r.report.floorRow(streamName, "dial_first_echo_p99_us", us(de, 0.99), us(se, 0.99))
	}
	if ce, ok := firstEchoes[connectName]; ok {
		// A CONNECT's 200 comes once the tunnel is established, as a Dial's
		// established does.
		c := dials[connectName]
		r.report.floorRow(connectName, "dial_p50_us", us(d, 0.5), us(c, 0.5))
		r.report.floorRow(connectName, "dial_p99_us", us(d, 0.99), us(c, 0.99))
		r.report.floorRow(connectName, "dial_first_echo_p50_us", us(de, 0.5), us(ce, 0.5))
		r.report.floorRow(connectName, "dial_first_echo_p99_us", us(de, 0.99), us(ce, 0.99))
	}
}

package main

import (
	"context"
	"math"
	"net"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// throughput moves cfg.size bytes over one connection each way, on each
// path, and reports MiB/s from the request to the last byte (download) or to
// the target's acknowledgement that it read every byte (upload). The peer
// and relay paths, when they run, are measured after the tunnel.
func (r *runner) throughput(ctx context.Context) {
	for _, dir := range []transferDirection{
		{"download", bench.Download},
		{"upload", bench.Upload},
	} {
		rates := map[string]float64{}
		cpu := map[string]cpuTimes{}
		for _, p := range r.allPaths() {
			rates[p.name], cpu[p.name] = r.transferOn(ctx, p, dir)
		}
		r.reportThroughput("throughput_"+dir.name, rates, cpu)
	}
}

// transferDirection is a bulk transfer of throughput: its name, and how
// it moves n bytes on a connection with a buffer.
type transferDirection struct {
	name string
	run  func(c net.Conn, n int64, buf []byte) error
}

// transferOn moves cfg.size bytes on a new connection of path p in
// direction dir, and returns the rate (MiB/s, NaN if the transfer failed)
// and the CPU every process used meanwhile.
func (r *runner) transferOn(ctx context.Context, p path, dir transferDirection) (float64, cpuTimes) {
	stop := r.profilePath(ctx, p, "throughput-"+dir.name, r.estimate())
	c := r.dialOrFatal(ctx, p, svcBulk)
	// Bounded: a stuck transfer fails at the deadline.
	_ = c.SetDeadline(time.Now().Add(r.cfg.timeout))
	buf := make([]byte, bench.BulkBuffer)
	cpu0, start := r.cpu(), time.Now()
	err := dir.run(c, r.cfg.size, buf)
	took := time.Since(start)
	used := r.cpu().sub(cpu0)
	c.Close()
	stop()
	if err != nil {
		r.logf("%s %s: %v", p.name, dir.name, err)
		return math.NaN(), used
	}
	r.logf("%s %s: %s in %v", p.name, dir.name, bytesString(r.cfg.size), took.Round(time.Millisecond))
	return float64(r.cfg.size) / (1 << 20) / took.Seconds(), used
}

// reportThroughput reports the rates and CPU per GiB of one direction's
// transfers, figures named name, on each path that ran.
func (r *runner) reportThroughput(name string, rates map[string]float64, cpu map[string]cpuTimes) {
	r.report.row(name+"_MiBps", rates["direct"], rates["tunneled"])
	gib := float64(r.cfg.size) / (1 << 30)
	perGiB := func(d time.Duration) float64 { return d.Seconds() / gib }
	d, t := cpu["direct"], cpu["tunneled"]
	r.report.row(name+"_cpu_s_per_GiB", perGiB(d.total()), perGiB(t.total()))
	r.report.row(name+"_broker_cpu_s_per_GiB", none, perGiB(t.broker))
	r.report.row(name+"_agent_cpu_s_per_GiB", none, perGiB(t.agent))
	r.report.row(name+"_middle_cpu_s_per_GiB", none, perGiB(t.middle("tunneled")))
	if r.relay != nil {
		rl := cpu["relay"]
		r.report.relayRow(name+"_MiBps", rates["direct"], rates["relay"])
		r.report.relayRow(name+"_cpu_s_per_GiB", perGiB(d.total()), perGiB(rl.total()))
		r.report.relayRow(name+"_relay1_cpu_s_per_GiB", none, perGiB(rl.relay1))
		r.report.relayRow(name+"_relay2_cpu_s_per_GiB", none, perGiB(rl.relay2))
		r.report.relayRow(name+"_middle_cpu_s_per_GiB", none, perGiB(rl.middle("relay")))
	}
	if r.peer != nil {
		pr := cpu[peerName]
		r.report.floorRow(peerName, name+"_MiBps", rates["direct"], rates[peerName])
		r.report.floorRow(peerName, name+"_cpu_s_per_GiB", perGiB(d.total()), perGiB(pr.total()))
		r.report.floorRow(peerName, name+"_server_cpu_s_per_GiB", none, perGiB(pr.peerServer))
		r.report.floorRow(peerName, name+"_client_cpu_s_per_GiB", none, perGiB(pr.peerClient))
		r.report.floorRow(peerName, name+"_middle_cpu_s_per_GiB", none, perGiB(pr.middle(peerName)))
	}
}

// estimate is how long a tunneled transfer will roughly take, for the CPU
// profile's window: at 200 MiB/s, 2 to 10 seconds.
func (r *runner) estimate() time.Duration {
	d := time.Duration(float64(r.cfg.size) / (200 << 20) * float64(time.Second))
	return min(max(d, 2*time.Second), 10*time.Second)
}

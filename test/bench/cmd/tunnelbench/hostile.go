package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// hostileCase is one kind of stream a peer with a valid SVID opens and
// never finishes: which RPC, as whom, and whether it sends most of a
// maximal first message or nothing at all.
type hostileCase struct {
	name   string
	method string
	as     string // identity path
	most   bool
}

var hostileCases = []hostileCase{
	{"dial_silent", "/kcp.tunnel.v1.DialService/Dial", "/kcp", false},
	{"dial_most", "/kcp.tunnel.v1.DialService/Dial", "/kcp", true},
	{"tunnel_most", "/kcp.tunnel.v1.AgentService/Tunnel", agentPath, true},
	{"connect_most", "/kcp.tunnel.v1.AgentService/Connect", agentPath, true},
}

// hostileWriters is how many streams send their bytes at once.
const hostileWriters = 32

// hostile measures what a peer with a valid SVID can make the broker hold
// with streams that never send a whole first message. For each case it
// starts a fresh broker (so that earlier phases' heaps hide nothing), opens
// cfg.hostileStreams streams from one identity on one connection, sends each
// nothing or the prefix of a message of cfg.hostileMessage bytes and all of
// it but its last byte (in DATA frames of cfg.hostileFrame bytes), and stops.
// It reports the broker's resident memory before, at its peak while the
// streams are held, and after they ended; how long until the broker had
// ended them all (from the first stream's opening), and how many it had
// not ended within cfg.hostileWait. A line per case says how they ended.
func (r *runner) hostile(ctx context.Context) {
	for _, c := range hostileCases {
		r.hostileRun(ctx, c)
	}
	for _, c := range hostileTunnelCases {
		r.hostileTunnels(ctx, c)
	}
}

func (r *runner) hostileRun(ctx context.Context, c hostileCase) {
	cfg := r.cfg
	broker, addr := r.env.StartBrokerProcess()
	defer func() { _ = broker.Stop() }()
	pid := broker.Cmd.Process.Pid
	conn := r.env.RawConn(addr, c.as)
	defer conn.Close()
	conn.Padding = cfg.hostilePad
	time.Sleep(settle)
	before := r.rssMiB(pid)

	peak := before
	sampled := make(chan struct{})
	stopSampling := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			peak = max(peak, r.rssMiB(pid))
			select {
			case <-stopSampling:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()

	var message []byte
	if c.most {
		message = append(harness.GRPCPrefix(int(cfg.hostileMessage)), make([]byte, cfg.hostileMessage-1)...)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.hostileWait)
	defer cancel()
	start := time.Now()
	streams := make([]*harness.RawStream, 0, cfg.hostileStreams)
	var openErr error
	for range cfg.hostileStreams {
		s, err := conn.Open(c.method)
		if err != nil {
			openErr = err
			break
		}
		streams = append(streams, s)
	}
	work := make(chan *harness.RawStream)
	var wg sync.WaitGroup
	for range hostileWriters {
		wg.Go(func() {
			for s := range work {
				// A stream the broker ends early takes no more: that is
				// the point.
				_ = s.Write(ctx, message, cfg.hostileFrame)
			}
		})
	}
	for _, s := range streams {
		work <- s
	}
	close(work)
	wg.Wait()

	codes := map[string]int{}
	left := 0
	var lastEnd time.Time
	for _, s := range streams {
		st, err := s.Wait(ctx)
		if err != nil {
			left++
			continue
		}
		codes[st.Code().String()]++
		lastEnd = time.Now()
	}
	ended := time.Since(start)
	if left == 0 {
		ended = lastEnd.Sub(start)
	}
	close(stopSampling)
	<-sampled
	for _, s := range streams {
		_ = s.Reset()
	}
	time.Sleep(settle)
	after := r.rssMiB(pid)

	var summary []string
	for _, code := range slices.Sorted(maps.Keys(codes)) {
		summary = append(summary, fmt.Sprintf("%d %s", codes[code], code))
	}
	if openErr != nil {
		summary = append(summary, fmt.Sprintf("opening stopped after %d: %v", len(streams), openErr))
	}
	if left > 0 {
		summary = append(summary, fmt.Sprintf("%d not ended within %v", left, cfg.hostileWait))
	}
	r.report.note("hostile %s: %d streams as %s, %s each in %d-byte frames with %d bytes of padding: %s", c.name, len(streams), c.as,
		map[bool]string{true: fmt.Sprintf("all but the last byte of a %d-byte message", cfg.hostileMessage), false: "nothing"}[c.most],
		cfg.hostileFrame, cfg.hostilePad, strings.Join(summary, ", "))
	name := "hostile_" + c.name + "_"
	r.report.hostileRow(name+"broker_rss_MiB_before", before)
	r.report.hostileRow(name+"broker_rss_MiB_peak", peak)
	r.report.hostileRow(name+"broker_rss_MiB_after", after)
	endedS := ended.Seconds()
	if left > 0 {
		endedS = none
	}
	r.report.hostileRow(name+"all_ended_s", endedS)
	r.report.hostileRow(name+"streams_not_ended", float64(left))
}

// rssMiB is the resident memory of process pid.
func (r *runner) rssMiB(pid int) float64 {
	st, err := bench.ReadProcStatus(pid)
	if err != nil {
		r.m.Fatal(err)
	}
	return float64(st.RSSKiB) / 1024
}

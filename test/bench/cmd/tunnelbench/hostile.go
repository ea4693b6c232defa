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

// hostileRun is one case of hostile, on a broker of its own.
func (r *runner) hostileRun(ctx context.Context, c hostileCase) {
	cfg := r.cfg
	broker, addr := r.env.StartBrokerProcess()
	defer func() { _ = broker.Stop() }()
	conn := r.env.RawConn(addr, c.as)
	defer conn.Close()
	conn.Padding = cfg.hostilePad
	rss := r.watchRSS(broker.Cmd.Process.Pid)

	var message []byte
	if c.most {
		message = append(harness.GRPCPrefix(int(cfg.hostileMessage)), make([]byte, cfg.hostileMessage-1)...)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.hostileWait)
	defer cancel()
	start := time.Now()
	streams, openErr := openStreams(conn, c.method, cfg.hostileStreams)
	wait := writeAll(ctx, streams, message, cfg.hostileFrame)
	wait()
	ends := waitEnded(ctx, streams, start)
	rss.stop()
	// The peer gives up on every stream, so that the reading after shows
	// what the broker keeps once they are all gone.
	for _, s := range streams {
		_ = s.Reset()
	}
	after := rss.settled()

	summary, _ := countsByCode(ends.codes, "%d %s")
	if openErr != nil {
		summary = append(summary, fmt.Sprintf("opening stopped after %d: %v", len(streams), openErr))
	}
	if ends.left > 0 {
		summary = append(summary, fmt.Sprintf("%d not ended within %v", ends.left, cfg.hostileWait))
	}
	r.report.note("hostile %s: %d streams as %s, %s each in %d-byte frames with %d bytes of padding: %s", c.name, len(streams), c.as,
		map[bool]string{true: fmt.Sprintf("all but the last byte of a %d-byte message", cfg.hostileMessage), false: "nothing"}[c.most],
		cfg.hostileFrame, cfg.hostilePad, strings.Join(summary, ", "))
	name := "hostile_" + c.name + "_"
	rss.rows(name, after)
	endedS := ends.all.Seconds()
	if ends.left > 0 {
		endedS = none
	}
	r.report.hostileRow(name+"all_ended_s", endedS)
	r.report.hostileRow(name+"streams_not_ended", float64(ends.left))
}

// openStreams opens n streams of method on conn, and stops at the first
// error: how many the broker lets one connection open is a figure too.
func openStreams(conn *harness.RawConn, method string, n int) ([]*harness.RawStream, error) {
	streams := make([]*harness.RawStream, 0, n)
	for range n {
		s, err := conn.Open(method)
		if err != nil {
			return streams, err
		}
		streams = append(streams, s)
	}
	return streams, nil
}

// writeAll has hostileWriters goroutines write payload, in frames of frame
// bytes, on each of streams, so that a broker slow to take one stream's
// bytes does not hold back the others. It returns a function that waits
// until every write returned. A stream the broker ends early takes no
// more: that is the point, so write errors are ignored.
func writeAll(ctx context.Context, streams []*harness.RawStream, payload []byte, frame int) (wait func()) {
	work := make(chan *harness.RawStream)
	var wg sync.WaitGroup
	for range hostileWriters {
		wg.Go(func() {
			for s := range work {
				_ = s.Write(ctx, payload, frame)
			}
		})
	}
	go func() {
		for _, s := range streams {
			work <- s
		}
		close(work)
	}()
	return wg.Wait
}

// streamEnds is how the broker ended a case's streams.
type streamEnds struct {
	codes map[string]int // streams ended, by status code
	left  int            // streams not ended before the context's end
	all   time.Duration  // from start until the last one ended, or until the wait gave up if some were left
}

// waitEnded waits, until ctx ends, for the broker to end each of streams.
func waitEnded(ctx context.Context, streams []*harness.RawStream, start time.Time) streamEnds {
	ends := streamEnds{codes: map[string]int{}}
	var lastEnd time.Time
	for _, s := range streams {
		st, err := s.Wait(ctx)
		if err != nil {
			ends.left++
			continue
		}
		ends.codes[st.Code().String()]++
		lastEnd = time.Now()
	}
	ends.all = time.Since(start)
	if ends.left == 0 {
		ends.all = lastEnd.Sub(start)
	}
	return ends
}

// countsByCode is one line per status code, in the codes' order, each as
// format prints the count and the code; and the sum of the counts.
func countsByCode(codes map[string]int, format string) (lines []string, total int) {
	for _, code := range slices.Sorted(maps.Keys(codes)) {
		total += codes[code]
		lines = append(lines, fmt.Sprintf(format, codes[code], code))
	}
	return lines, total
}

// rssWatch follows the broker's resident memory through a hostile case:
// before the attack, its peak during it (sampled every 50ms) and after.
type rssWatch struct {
	r            *runner
	pid          int
	before, peak float64
	stopping     chan struct{}
	stopped      chan struct{}
}

// watchRSS gives process pid settle to start up, reads its resident memory
// and samples it from then on.
func (r *runner) watchRSS(pid int) *rssWatch {
	time.Sleep(settle)
	w := &rssWatch{r: r, pid: pid, stopping: make(chan struct{}), stopped: make(chan struct{})}
	w.before = r.rssMiB(pid)
	w.peak = w.before
	go func() {
		defer close(w.stopped)
		for {
			w.peak = max(w.peak, r.rssMiB(pid))
			select {
			case <-w.stopping:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	return w
}

// stop ends the sampling: the peak is final once it returns.
func (w *rssWatch) stop() {
	close(w.stopping)
	<-w.stopped
}

// settled is the resident memory once the process had settle to give
// back what it can.
func (w *rssWatch) settled() float64 {
	time.Sleep(settle)
	return w.r.rssMiB(w.pid)
}

// rows reports before, peak and after as the case's figures named name.
func (w *rssWatch) rows(name string, after float64) {
	w.r.report.hostileRow(name+"broker_rss_MiB_before", w.before)
	w.r.report.hostileRow(name+"broker_rss_MiB_peak", w.peak)
	w.r.report.hostileRow(name+"broker_rss_MiB_after", after)
}

// rssMiB is the resident memory of process pid.
func (r *runner) rssMiB(pid int) float64 {
	st, err := bench.ReadProcStatus(pid)
	if err != nil {
		r.m.Fatal(err)
	}
	return float64(st.RSSKiB) / 1024
}

package main

import (
	"bufio"
	"context"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/test/bench"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// The scale phase's simulated agents run in a child process of their own,
// the load process (role "scale-load"), so that their CPU and their Go
// runtime stay apart from tunnelbench's callers and from the broker's
// figures. tunnelbench drives it with one JSON loadRequest a line on its
// stdin and reads one JSON loadReply a line from its stdout; it exits when
// its stdin closes.
const (
	roleScaleLoad = "scale-load"
	// Where the load process finds the trust domain's CA, to issue each
	// simulated agent an SVID of its own in memory.
	envScaleCACert = "TUNNELBENCH_SCALE_CA_CERT"
	envScaleCAKey  = "TUNNELBENCH_SCALE_CA_KEY"
)

// The load process is this program again; it is told apart before main
// runs, so that main's list of child roles stays as it is.
func init() {
	if os.Getenv(roleEnv) == roleScaleLoad {
		serveScaleLoad()
	}
}

// loadRequest is one command to the load process.
type loadRequest struct {
	Op     string // register, reregister, wire, restart, restart_wait, vanish
	Broker string // the broker's label: the load process keeps agents by it
	Addr   string // the broker's address, for register

	// register: agents Indices, each serving PerAgent clusters, at most
	// InFlight registering at once.
	Indices  []int
	PerAgent int
	InFlight int

	// reregister: agent Index states, in turn, the lists of PerAgent
	// clusters starting at each of Froms.
	Index int
	Froms []int

	// restart: agents Indices of Broker disconnect and reconnect once
	// each, in index order, spread over Over.
	Over time.Duration
}

// loadReply answers a loadRequest; Err is set when it failed.
type loadReply struct {
	Err string `json:",omitempty"`

	// register: how long all took, each agent's time from its first
	// connection attempt to registered, and how many failed.
	Took      time.Duration
	Latencies []time.Duration
	Failed    int

	// wire: the bytes the agents of Broker read and wrote so far.
	Read, Written int64

	// restart: when it started (unix ns); register, restart_wait and
	// vanish: each agent's time away (unix ns, from its disconnect to its new
	// registered; an end of 0 means it never came back), by index.
	Start int64
	Away  map[int][2]int64
}

// scaleAgentName is the sync target, agent name and SVID path segment of
// simulated agent i.
func scaleAgentName(i int) string { return fmt.Sprintf("st-%08d", i) }

// scaleCluster is cluster k of agent i: 16 digits, as long as kcp's
// logical cluster names.
func scaleCluster(i, k int) string { return fmt.Sprintf("%08d%08d", i, k) }

// scaleClusters are the n clusters of agent i from cluster from on.
func scaleClusters(i, from, n int) []string {
	out := make([]string, n)
	for k := range n {
		out[k] = scaleCluster(i, from+k)
	}
	return out
}

type loadProcess struct {
	ca *devca.CA

	mu     sync.Mutex
	agents map[string]map[int]*bench.SimAgent // broker label -> index -> agent
	addrs  map[string]string
	wire   map[string]*bench.WireCounter
	srcs   map[int]*devca.Source

	restartDone chan loadReply
}

// serveScaleLoad is the load process's main.
func serveScaleLoad() {
	ca, err := loadCA(os.Getenv(envScaleCACert), os.Getenv(envScaleCAKey))
	if err != nil {
		fmt.Fprintln(os.Stderr, "scale load:", err)
		os.Exit(1)
	}
	l := &loadProcess{ca: ca, agents: map[string]map[int]*bench.SimAgent{}, addrs: map[string]string{},
		wire: map[string]*bench.WireCounter{}, srcs: map[int]*devca.Source{}}
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 64<<20)
	out := json.NewEncoder(os.Stdout)
	fmt.Println("listening load")
	for in.Scan() {
		var req loadRequest
		var rep loadReply
		if err := json.Unmarshal(in.Bytes(), &req); err != nil {
			rep.Err = err.Error()
		} else {
			rep = l.do(req)
		}
		if err := out.Encode(rep); err != nil {
			os.Exit(1)
		}
	}
	// tunnelbench is gone or done: drop every connection.
	os.Exit(0)
}

func loadCA(certFile, keyFile string) (*devca.CA, error) {
	certPEM, err := os.ReadFile(certFile)
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(keyFile)
	if err != nil {
		return nil, err
	}
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, fmt.Errorf("CA files hold no PEM")
	}
	cert, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, err
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, err
	}
	return &devca.CA{Cert: cert, Key: key, TrustDomain: harness.TrustDomain}, nil
}

func (l *loadProcess) do(req loadRequest) loadReply {
	switch req.Op {
	case "register":
		return l.register(req)
	case "reregister":
		l.mu.Lock()
		a := l.agents[req.Broker][req.Index]
		l.mu.Unlock()
		if a == nil {
			return loadReply{Err: fmt.Sprintf("no agent %d at %s", req.Index, req.Broker)}
		}
		for _, from := range req.Froms {
			if err := a.Reregister(scaleClusters(req.Index, from, req.PerAgent)); err != nil {
				return loadReply{Err: err.Error()}
			}
		}
		return loadReply{}
	case "wire":
		l.mu.Lock()
		w := l.wireOf(req.Broker)
		l.mu.Unlock()
		return loadReply{Read: w.Read.Load(), Written: w.Written.Load()}
	case "restart":
		if l.restartDone != nil {
			return loadReply{Err: "a restart is under way"}
		}
		l.restartDone = make(chan loadReply, 1)
		start := time.Now()
		go func() { l.restartDone <- l.restart(req, start) }()
		return loadReply{Start: start.UnixNano()}
	case "vanish":
		return l.vanish(req)
	case "restart_wait":
		if l.restartDone == nil {
			return loadReply{Err: "no restart under way"}
		}
		rep := <-l.restartDone
		l.restartDone = nil
		return rep
	}
	return loadReply{Err: fmt.Sprintf("unknown op %q", req.Op)}
}

// wireOf is broker's byte counter; l.mu is held.
func (l *loadProcess) wireOf(broker string) *bench.WireCounter {
	w := l.wire[broker]
	if w == nil {
		w = &bench.WireCounter{}
		l.wire[broker] = w
	}
	return w
}

// source is agent i's SVID, issued once: an agent keeps its identity
// across reconnects and brokers.
func (l *loadProcess) source(i int) (*devca.Source, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s := l.srcs[i]; s != nil {
		return s, nil
	}
	s, err := l.ca.Source(devca.Leaf{SPIFFEID: "/agent/" + scaleAgentName(i)})
	if err != nil {
		return nil, err
	}
	l.srcs[i] = s
	return s, nil
}

// connect registers agent i with broker, serving perAgent clusters.
func (l *loadProcess) connect(broker string, i, perAgent int) (*bench.SimAgent, error) {
	src, err := l.source(i)
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	addr, wire := l.addrs[broker], l.wireOf(broker)
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return bench.StartSimAgent(ctx, bench.SimAgentConfig{
		Broker: addr, BrokerID: harness.ID("/broker"), Source: src,
		Name: scaleAgentName(i), Clusters: scaleClusters(i, 0, perAgent), Wire: wire,
	})
}

// register registers req.Indices, at most req.InFlight at once, each as
// soon as a place is free.
func (l *loadProcess) register(req loadRequest) loadReply {
	l.mu.Lock()
	l.addrs[req.Broker] = req.Addr
	if l.agents[req.Broker] == nil {
		l.agents[req.Broker] = map[int]*bench.SimAgent{}
	}
	l.mu.Unlock()
	// Issue the SVIDs first: a real agent has its SVID before it connects.
	for _, i := range req.Indices {
		if _, err := l.source(i); err != nil {
			return loadReply{Err: err.Error()}
		}
	}
	latencies := make([]time.Duration, len(req.Indices))
	away := make(map[int][2]int64, len(req.Indices))
	var awayMu sync.Mutex
	var failed atomic.Int64
	var firstErr atomic.Value
	places := make(chan struct{}, max(1, req.InFlight))
	var wg sync.WaitGroup
	start := time.Now()
	for n, i := range req.Indices {
		places <- struct{}{}
		wg.Go(func() {
			defer func() { <-places }()
			l.mu.Lock()
			old := l.agents[req.Broker][i]
			l.mu.Unlock()
			if old != nil {
				// Its broker restarted: the agent comes back.
				old.Close()
			}
			t := time.Now()
			a, err := l.connect(req.Broker, i, req.PerAgent)
			if err != nil {
				failed.Add(1)
				firstErr.CompareAndSwap(nil, fmt.Sprintf("agent %d: %v", i, err))
				awayMu.Lock()
				away[i] = [2]int64{t.UnixNano(), 0}
				awayMu.Unlock()
				return
			}
			latencies[n] = time.Since(t)
			awayMu.Lock()
			away[i] = [2]int64{t.UnixNano(), a.Registered.UnixNano()}
			awayMu.Unlock()
			l.mu.Lock()
			l.agents[req.Broker][i] = a
			l.mu.Unlock()
		})
	}
	wg.Wait()
	rep := loadReply{Took: time.Since(start), Latencies: latencies, Failed: int(failed.Load()), Away: away}
	if e, ok := firstErr.Load().(string); ok {
		fmt.Fprintln(os.Stderr, "scale load: register:", e)
	}
	return rep
}

// restart disconnects and reconnects every agent of req.Broker once, in
// index order, agent n of N at start + n*Over/N. Even indices unregister
// cleanly first (as an agent that stops does); odd ones drop their
// connection (as a crashed agent's kernel would). Each reconnects at once,
// and tries again on failure, as an agent does, with backoff.
func (l *loadProcess) restart(req loadRequest, start time.Time) loadReply {
	indices := slices.Sorted(slices.Values(req.Indices))
	perAgent := req.PerAgent
	away := make(map[int][2]int64, len(indices))
	var awayMu sync.Mutex
	var wg sync.WaitGroup
	for n, i := range indices {
		time.Sleep(time.Until(start.Add(time.Duration(n) * req.Over / time.Duration(len(indices)))))
		wg.Go(func() {
			l.mu.Lock()
			old := l.agents[req.Broker][i]
			l.mu.Unlock()
			if old == nil {
				return
			}
			left := time.Now()
			if i%2 == 0 {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				_ = old.Unregister(ctx)
				cancel()
			} else {
				old.Close()
			}
			var back int64
			for try, wait := 0, 250*time.Millisecond; try < 6; try, wait = try+1, wait*2 {
				a, err := l.connect(req.Broker, i, perAgent)
				if err == nil {
					back = a.Registered.UnixNano()
					l.mu.Lock()
					l.agents[req.Broker][i] = a
					l.mu.Unlock()
					break
				}
				fmt.Fprintf(os.Stderr, "scale load: agent %d reconnecting: %v\n", i, err)
				time.Sleep(wait)
			}
			awayMu.Lock()
			away[i] = [2]int64{left.UnixNano(), back}
			awayMu.Unlock()
		})
	}
	wg.Wait()
	return loadReply{Took: time.Since(start), Away: away}
}

// vanish makes agents Indices of Broker hang (bench.SimAgent.Vanish: their
// sockets stay open, silent, until the load process exits) and reconnects
// each at once on a new connection, as an agent restarted elsewhere would.
func (l *loadProcess) vanish(req loadRequest) loadReply {
	away := make(map[int][2]int64, len(req.Indices))
	for _, i := range req.Indices {
		l.mu.Lock()
		old := l.agents[req.Broker][i]
		l.mu.Unlock()
		if old == nil {
			return loadReply{Err: fmt.Sprintf("no agent %d at %s", i, req.Broker)}
		}
		left := time.Now()
		old.Vanish()
		a, err := l.connect(req.Broker, i, req.PerAgent)
		if err != nil {
			return loadReply{Err: fmt.Sprintf("agent %d reconnecting: %v", i, err)}
		}
		l.mu.Lock()
		l.agents[req.Broker][i] = a
		l.mu.Unlock()
		away[i] = [2]int64{left.UnixNano(), a.Registered.UnixNano()}
	}
	return loadReply{Away: away}
}

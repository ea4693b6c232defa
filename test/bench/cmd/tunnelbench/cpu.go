package main

import (
	"os"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// cpuTimes is the CPU time used so far by this process (callers and
// targets), the main pair's broker and its agent, relays 1 and 2 and the
// peer's server and client when they run (the processes of the paths not
// being measured idle meanwhile). The delaying relays of -hop-delay are
// not counted: they stand for the network.
// Differences of two readings say what a measurement cost, which is steadier
// than its rate on a loaded machine. The resolution is 10ms: measurements
// long enough to use seconds of CPU are needed.
type cpuTimes struct {
	self, broker, agent, relay1, relay2 time.Duration
	peerServer, peerClient              time.Duration
}

func (r *runner) cpu() cpuTimes {
	var t cpuTimes
	read := func(pid int, d *time.Duration) {
		var err error
		if *d, err = bench.ProcCPU(pid); err != nil {
			r.m.Fatal(err)
		}
	}
	read(os.Getpid(), &t.self)
	read(r.main.broker.Cmd.Process.Pid, &t.broker)
	read(r.main.agent.Cmd.Process.Pid, &t.agent)
	if r.relay != nil {
		read(r.relay.pids[0], &t.relay1)
		read(r.relay.pids[1], &t.relay2)
	}
	if r.peer != nil {
		read(r.peer.serverPID, &t.peerServer)
		read(r.peer.clientPID, &t.peerClient)
	}
	return t
}

func (t cpuTimes) sub(u cpuTimes) cpuTimes {
	return cpuTimes{self: t.self - u.self, broker: t.broker - u.broker, agent: t.agent - u.agent,
		relay1: t.relay1 - u.relay1, relay2: t.relay2 - u.relay2,
		peerServer: t.peerServer - u.peerServer, peerClient: t.peerClient - u.peerClient}
}

// total is what all the processes used.
func (t cpuTimes) total() time.Duration {
	return t.self + t.middle("tunneled") + t.middle("relay") + t.middle(peerName)
}

// middle is what the middle processes of path used: those between the
// caller and the target; none for the direct path.
func (t cpuTimes) middle(path string) time.Duration {
	m := t.middleOf(path)
	return m.used[0] + m.used[1]
}

// middleUse is what each of a path's two middle processes used, and their
// names in rows.
type middleUse struct {
	names [2]string
	used  [2]time.Duration
}

// middleOf is what the two middle processes of path used, in order: the
// broker and agent (for every path through the main pair), relays 1 and 2,
// the peer's server and client; none for the direct path.
func (t cpuTimes) middleOf(path string) middleUse {
	switch path {
	case "tunneled", earlyName, connectName:
		return middleUse{[2]string{"broker", "agent"}, [2]time.Duration{t.broker, t.agent}}
	case "relay":
		return middleUse{[2]string{"relay1", "relay2"}, [2]time.Duration{t.relay1, t.relay2}}
	case peerName:
		return middleUse{[2]string{"server", "client"}, [2]time.Duration{t.peerServer, t.peerClient}}
	}
	return middleUse{}
}

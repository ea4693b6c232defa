package main

import (
	"os"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// cpuTimes is the CPU time used so far by this process (callers and
// targets), the main pair's broker and its agent, and relays 1 and 2 when
// they run (the processes of the paths not being measured idle meanwhile).
// Differences of two readings say what a measurement cost, which is steadier
// than its rate on a loaded machine. The resolution is 10ms: measurements
// long enough to use seconds of CPU are needed.
type cpuTimes struct{ self, broker, agent, relay1, relay2 time.Duration }

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
	return t
}

func (t cpuTimes) sub(u cpuTimes) cpuTimes {
	return cpuTimes{self: t.self - u.self, broker: t.broker - u.broker, agent: t.agent - u.agent,
		relay1: t.relay1 - u.relay1, relay2: t.relay2 - u.relay2}
}

// total is what all the processes used.
func (t cpuTimes) total() time.Duration {
	return t.self + t.broker + t.agent + t.relay1 + t.relay2
}

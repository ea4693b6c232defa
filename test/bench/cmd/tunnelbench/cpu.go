package main

import (
	"os"
	"time"

	"github.com/kcp-dev/tunnel-broker/test/bench"
)

// cpuTimes is the CPU time used so far by this process (callers and
// targets), the main pair's broker and its agent. Differences of two
// readings say what a measurement cost, which is steadier than its rate on
// a loaded machine. The resolution is 10ms: measurements long enough to use
// seconds of CPU are needed.
type cpuTimes struct{ self, broker, agent time.Duration }

func (r *runner) cpu() cpuTimes {
	var t cpuTimes
	var err error
	for _, x := range []struct {
		pid int
		d   *time.Duration
	}{
		{os.Getpid(), &t.self},
		{r.main.broker.Cmd.Process.Pid, &t.broker},
		{r.main.agent.Cmd.Process.Pid, &t.agent},
	} {
		if *x.d, err = bench.ProcCPU(x.pid); err != nil {
			r.m.Fatal(err)
		}
	}
	return t
}

func (t cpuTimes) sub(u cpuTimes) cpuTimes {
	return cpuTimes{self: t.self - u.self, broker: t.broker - u.broker, agent: t.agent - u.agent}
}

// total is what all three processes used.
func (t cpuTimes) total() time.Duration { return t.self + t.broker + t.agent }

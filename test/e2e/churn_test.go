package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// churnDials is how many dials TestChurn makes; TUNNEL_CHURN_DIALS changes
// it (e.g. for a long soak).
const churnDials = 3000

// churnConcurrency bounds the dials in flight at once.
const churnConcurrency = 32

// opTimeout bounds every dial and every read or write of one churn
// operation, so that a hang fails the operation instead of the test run.
const opTimeout = 20 * time.Second

// churnOp is one way a tunnel can be opened and closed. run does it once
// and returns an error if anything came out other than expected; outcome
// names how it went, for the tally.
type churnOp struct {
	name string
	run  func(ctx context.Context, rng *rand.Rand) (outcome string, err error)
}

// TestChurn opens and closes thousands of tunnels through an in-process
// broker and agent, in every way a tunnel can end, checks each one's outcome
// and then that the broker, the agent, the targets and the callers (all in
// this process) are back to the goroutines and open files they had before.
func TestChurn(t *testing.T) {
	dials := churnDialCount(t)
	env := harness.NewEnv(t)
	b := env.StartBroker(harness.BrokerOptions{})
	startChurnTargets(t, env, b.Addr)
	ops := churnOps(env.Dialer(b.Addr, "/kcp"))

	// Warm up: every kind of operation a few times, so that whatever is
	// made once per process or connection exists before the baseline.
	for _, op := range ops {
		for range 3 {
			if _, err := op.run(context.Background(), rand.New(rand.NewPCG(1, 2))); err != nil {
				t.Fatalf("warm-up %s: %v", op.name, err)
			}
		}
	}
	base := quietBaseline(t, b)

	start := time.Now()
	tally := runChurn(t, ops, dials)
	t.Logf("%d dials in %v, %d at a time", dials, time.Since(start).Round(time.Millisecond), churnConcurrency)
	for _, op := range ops {
		for _, outcome := range slices.Sorted(maps.Keys(tally[op.name])) {
			t.Logf("  %4d  %s: %s", tally[op.name][outcome], op.name, outcome)
		}
	}

	base.checkNoLeaks(t, "after the churn")
	if n := brokerTunnels(b); n != 0 {
		t.Errorf("the broker still counts %d tunnels", n)
	}
}

// churnDialCount is how many dials TestChurn makes: churnDials, or
// TUNNEL_CHURN_DIALS if set.
func churnDialCount(t *testing.T) int {
	t.Helper()
	s := os.Getenv("TUNNEL_CHURN_DIALS")
	if s == "" {
		return churnDials
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		t.Fatalf("TUNNEL_CHURN_DIALS=%q: want a positive number", s)
	}
	return n
}

// startChurnTargets starts the churn's targets (an echo server, one that
// resets at once, one that closes at once, one that keeps sending) behind
// an agent of cluster root, and a silent agent of cluster silent, whose
// dials wait until the caller gives up, with the broker at brokerAddr.
func startChurnTargets(t *testing.T, env *harness.Env, brokerAddr string) {
	t.Helper()
	targets := map[string]string{
		"echo":    harness.StartEcho(t),
		"reset":   startTarget(t, resetAtOnce),
		"closer":  startTarget(t, closeAtOnce),
		"chatter": startTarget(t, chatter(nil)),
	}
	var services lookup.StaticFile
	for name, addr := range targets {
		services.Services = append(services.Services, lookup.StaticService{
			Cluster: "root", Namespace: "default", Name: name, Ports: map[string]string{"80": addr},
		})
	}
	env.StartAgent(brokerAddr, "/agent/sync-target-1", services)
	startSilentAgent(t, env, brokerAddr, "silent")
}

// runChurn runs dials of ops, cycling through them in a shuffled order,
// churnConcurrency at a time, and returns how each op's runs went, by
// outcome. It reports the first 100 failed runs, and how many more failed.
func runChurn(t *testing.T, ops []churnOp, dials int) (tally map[string]map[string]int) {
	t.Helper()
	type report struct {
		op, outcome string
		err         error
	}
	work := make(chan int)
	reports := make(chan report, churnConcurrency)
	var workers sync.WaitGroup
	for w := range churnConcurrency {
		workers.Add(1)
		go func() {
			defer workers.Done()
			rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for i := range work {
				op := ops[i%len(ops)]
				outcome, err := op.run(context.Background(), rng)
				reports <- report{op: op.name, outcome: outcome, err: err}
			}
		}()
	}
	go func() {
		// A shuffled mix, so that every kind overlaps every other.
		for _, i := range rand.Perm(dials) {
			work <- i
		}
		close(work)
		workers.Wait()
		close(reports)
	}()
	tally = map[string]map[string]int{}
	failures := 0
	for r := range reports {
		if r.err != nil {
			failures++
			if failures <= 100 {
				t.Errorf("%s: %v", r.op, r.err)
			}
			continue
		}
		if tally[r.op] == nil {
			tally[r.op] = map[string]int{}
		}
		tally[r.op][r.outcome]++
	}
	if failures > 100 {
		t.Errorf("... and %d more failed operations", failures-100)
	}
	return tally
}

// churnOps are the ways to open and close a tunnel that TestChurn mixes.
func churnOps(kcp *kcpplugin.Dialer) []churnOp {
	c := &churner{kcp: kcp}
	c.lastDial.Store(int64(time.Millisecond))
	return []churnOp{
		{"normal close after an echo round trip", c.echoThenClose},
		{"half-close, then read to EOF", c.halfCloseThenReadToEOF},
		{"caller closes without reading", c.closeUnread},
		{"caller closes while the target sends", c.closeWhileTargetSends},
		{"target resets at once", c.targetResets},
		{"target closes at once", c.targetCloses},
		{"caller cancels a pending dial", c.cancelPendingDial},
		{"caller's deadline passes on a pending dial", c.deadlineOnPendingDial},
		{"caller cancels while the agent connects", c.cancelWhileAgentConnects},
	}
}

// churner runs the churn's operations through kcp's dialer.
type churner struct {
	kcp *kcpplugin.Dialer
	// How long the last successful dial took, so that a cancellation
	// raced with a dial lands before or after it about evenly, however
	// loaded the machine is.
	lastDial atomic.Int64
}

// dial dials service of cluster root within opTimeout, and bounds the
// connection's reads and writes by opTimeout from then.
func (c *churner) dial(ctx context.Context, service string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	start := time.Now()
	conn, err := c.kcp.DialService(ctx, "root", "default", service, 80)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", service, err)
	}
	c.lastDial.Store(int64(time.Since(start)))
	conn.SetDeadline(time.Now().Add(opTimeout))
	return conn, nil
}

func (c *churner) echoThenClose(ctx context.Context, rng *rand.Rand) (string, error) {
	conn, err := c.dial(ctx, "echo")
	if err != nil {
		return "", err
	}
	defer conn.Close()
	if err := echoOnce(conn, payload(rng, 2048)); err != nil {
		return "", err
	}
	return "echoed", conn.Close()
}

func (c *churner) halfCloseThenReadToEOF(ctx context.Context, rng *rand.Rand) (string, error) {
	conn, err := c.dial(ctx, "echo")
	if err != nil {
		return "", err
	}
	defer conn.Close()
	msg := payload(rng, 16<<10)
	if _, err := conn.Write(msg); err != nil {
		return "", fmt.Errorf("write: %w", err)
	}
	if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		return "", fmt.Errorf("CloseWrite: %w", err)
	}
	got, err := io.ReadAll(conn)
	if err != nil {
		return "", fmt.Errorf("reading to EOF after %d bytes: %w", len(got), err)
	}
	if !bytes.Equal(got, msg) {
		return "", fmt.Errorf("echo returned %d bytes, want the %d sent", len(got), len(msg))
	}
	return "echoed to EOF", conn.Close()
}

func (c *churner) closeUnread(ctx context.Context, rng *rand.Rand) (string, error) {
	conn, err := c.dial(ctx, "echo")
	if err != nil {
		return "", err
	}
	if _, err := conn.Write(payload(rng, 4096)); err != nil {
		conn.Close()
		return "", fmt.Errorf("write: %w", err)
	}
	return "closed unread", conn.Close()
}

func (c *churner) closeWhileTargetSends(ctx context.Context, rng *rand.Rand) (string, error) {
	conn, err := c.dial(ctx, "chatter")
	if err != nil {
		return "", err
	}
	defer conn.Close()
	if _, err := io.ReadFull(conn, make([]byte, 1+rng.IntN(1024))); err != nil {
		return "", fmt.Errorf("read: %w", err)
	}
	return "closed mid-stream", conn.Close()
}

func (c *churner) targetResets(ctx context.Context, _ *rand.Rand) (string, error) {
	// The reset may reach the agent while it connects, before it opens
	// the tunnel, or after: the dial fails or the tunnel does, with
	// Unavailable either way, and at once.
	conn, err := c.dial(ctx, "reset")
	if err != nil {
		if status.Code(err) != codes.Unavailable {
			return "", fmt.Errorf("%v, want Unavailable", err)
		}
		return "Unavailable at dial", nil
	}
	defer conn.Close()
	n, err := conn.Read(make([]byte, 64))
	if n != 0 || status.Code(err) != codes.Unavailable {
		return "", fmt.Errorf("Read = %d, %v; want Unavailable", n, err)
	}
	return "Unavailable on Read", conn.Close()
}

func (c *churner) targetCloses(ctx context.Context, _ *rand.Rand) (string, error) {
	conn, err := c.dial(ctx, "closer")
	if err != nil {
		return "", err
	}
	defer conn.Close()
	n, err := conn.Read(make([]byte, 64))
	if n != 0 || !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("Read = %d, %v; want EOF", n, err)
	}
	return "EOF", conn.Close()
}

func (c *churner) cancelPendingDial(ctx context.Context, rng *rand.Rand) (string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	time.AfterFunc(time.Duration(rng.IntN(5000))*time.Microsecond, cancel)
	return c.dialSilent(ctx, codes.Canceled)
}

func (c *churner) deadlineOnPendingDial(ctx context.Context, rng *rand.Rand) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Duration(1+rng.IntN(10))*time.Millisecond)
	defer cancel()
	return c.dialSilent(ctx, codes.DeadlineExceeded)
}

// dialSilent dials through the silent agent, whose dials wait until the
// caller gives up as ctx says, and checks that the dial fails with want.
func (c *churner) dialSilent(ctx context.Context, want codes.Code) (string, error) {
	conn, err := c.kcp.DialService(ctx, "silent", "default", "echo", 80)
	if conn != nil {
		conn.Close()
	}
	if status.Code(err) != want {
		return "", fmt.Errorf("dial: %v, want %v", err, want)
	}
	return want.String(), nil
}

func (c *churner) cancelWhileAgentConnects(ctx context.Context, rng *rand.Rand) (string, error) {
	// Races the cancellation with the dial: either may win, and a dial
	// that won must work though its context is gone.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	time.AfterFunc(time.Duration(rng.Int64N(2*c.lastDial.Load()+1)), cancel)
	conn, err := c.kcp.DialService(ctx, "root", "default", "echo", 80)
	if err != nil {
		if status.Code(err) != codes.Canceled {
			return "", fmt.Errorf("dial: %v, want success or Canceled", err)
		}
		return "Canceled", nil
	}
	defer conn.Close()
	cancel()
	conn.SetDeadline(time.Now().Add(opTimeout))
	if err := echoOnce(conn, payload(rng, 512)); err != nil {
		return "", fmt.Errorf("after winning the race with cancel: %w", err)
	}
	return "established and echoed", conn.Close()
}

// echoOnce writes msg to an echo tunnel and checks that it comes back.
func echoOnce(conn net.Conn, msg []byte) error {
	if _, err := conn.Write(msg); err != nil {
		return fmt.Errorf("write: %w", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(conn, got); err != nil {
		return fmt.Errorf("read: %w", err)
	}
	if !bytes.Equal(got, msg) {
		return errors.New("echo returned other bytes than sent")
	}
	return nil
}

// payload is 1 to limit random bytes.
func payload(rng *rand.Rand, limit int) []byte {
	b := make([]byte, 1+rng.IntN(limit))
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

package agent

import (
	"context"
	"io"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// earlyOrder is dial order 1 with early data, as the broker sends every
// order whose caller sent some (docs/protocol.md §3.4).
func earlyOrder() *tunnelv1.DialOrder {
	order := dialOrder(1)
	order.EarlyData = []byte("client hello;")
	return order
}

func TestAnOrdersEarlyDataReachesTheTargetBeforeTheTunnelsData(t *testing.T) {
	_, tu, conn := establishedBy(t, earlyOrder())
	if err := tu.send([]byte("then data")); err != nil {
		t.Fatal(err)
	}
	if err := tu.closeWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "client hello;then data" {
		t.Errorf("the target read %q, want the early data, then the tunnel's data", got)
	}
}

// TestADialThatFailsBeforeItsOpenSaysItsEarlyDataWasNotSent: the broker
// may order such a dial again, to another agent.
func TestADialThatFailsBeforeItsOpenSaysItsEarlyDataWasNotSent(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	run(t, newAgent(t, p, b, staticResolver(t, refusedAddr(t))))
	s := b.nextSession(t)

	s.order(t, earlyOrder())
	f := s.failure(t)
	if codes.Code(f.GetCode()) != codes.Unavailable || f.GetEarlyDataSent() {
		t.Errorf("dial_failure{%v, %q, early_data_sent %v}, want Unavailable without early_data_sent", codes.Code(f.GetCode()), f.GetMessage(), f.GetEarlyDataSent())
	}
}

// TestATunnelThatFailsAsItOpensSaysItsEarlyDataMayHaveReachedTheTarget:
// the agent wrote it once the open was sent, so the broker must not
// order the dial again.
func TestATunnelThatFailsAsItOpensSaysItsEarlyDataMayHaveReachedTheTarget(t *testing.T) {
	s, tu, conn := establishedBy(t, earlyOrder())
	got := make([]byte, len("client hello;"))
	if _, err := io.ReadFull(conn, got); err != nil {
		t.Fatalf("the target read %q, %v; want the early data", got, err)
	}

	tu.finish(status.Error(codes.NotFound, "no pending dial"))
	f := s.failure(t)
	if f.GetDialId() != 1 || codes.Code(f.GetCode()) != codes.Unavailable || !f.GetEarlyDataSent() {
		t.Errorf("dial_failure{%d, %v, early_data_sent %v}, want {1, Unavailable, early_data_sent}", f.GetDialId(), codes.Code(f.GetCode()), f.GetEarlyDataSent())
	}
}

// TestTheEarlyDataWaitsForTheOpen: an agent that cannot open the
// tunnel's Tunnel stream (its broker vanished while it connected) has
// sent the target none of the early data, so that a dial that fails sent
// none.
func TestTheEarlyDataWaitsForTheOpen(t *testing.T) {
	p := newPKI(t)
	b := startBroker(t, p)
	tg := listenTarget(t)
	resolving, resolve := make(chan struct{}, 1), make(chan struct{})
	r := &funcResolver{clusters: []string{testCluster}, resolve: func(ctx context.Context, _ *tunnelv1.Target) ([]string, error) {
		resolving <- struct{}{}
		select {
		case <-resolve:
			return []string{tg.addr()}, nil
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}}
	a := newAgent(t, p, b, r)
	fakeClock(a) // which the test never moves: the agent does not register again
	logged := captureLog(t, a)
	run(t, a)
	s := b.nextSession(t)

	s.order(t, earlyOrder())
	testutil.Wait(t, "the agent to resolve the order's target", resolving)
	b.stop()
	logged.waitLine(t, "registration with the broker lost")
	close(resolve)
	conn := tg.accept(t)
	if got, _ := io.ReadAll(conn); len(got) != 0 {
		t.Errorf("the target read %q from a dial whose tunnel could not open, want nothing", got)
	}
	logged.waitLine(t, "could not open tunnel")
}

package bench

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/server"
	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// BenchmarkReregister is one re-registration per op: a simulated agent
// bound by a {syncTarget} policy rule to its sync target's clusters states
// a changed list (one cluster out, one in; the agent sends the whole
// list), and the op ends when a dial to the new cluster succeeds through
// the in-process broker. It is the time until the broker routes the new
// list, which for a large sync target is mostly the broker's checks of
// the list against the policy.
func BenchmarkReregister(b *testing.B) {
	for _, n := range []int{20, 10000} {
		b.Run(fmt.Sprintf("clusters=%d", n), func(b *testing.B) {
			env := harness.NewEnv(b)
			td := "spiffe://" + harness.TrustDomain
			clusters := func(from int) []string {
				out := make([]string, n)
				for k := range out {
					out[k] = fmt.Sprintf("ws%014d", from+k)
				}
				return out
			}
			pol := policy.File{
				Agents:      []policy.AgentRule{{ID: td + "/agent/{syncTarget}"}},
				SyncTargets: map[string][]string{"big": clusters(0)},
				Callers:     []policy.CallerRule{{ID: td + "/kcp"}},
			}
			pol.SyncTargets["big"] = append(pol.SyncTargets["big"], clusters(1)[n-1])
			broker := env.StartBroker(harness.BrokerOptions{Policy: &pol, Config: func(c *server.Config) { c.MaxReregistrationsPerSecond = -1 }})
			src, err := env.CA.Source(devca.Leaf{SPIFFEID: "/agent/big"})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			a, err := StartSimAgent(ctx, SimAgentConfig{Broker: broker.Addr, BrokerID: harness.ID("/broker"), Source: src, Name: "big", Clusters: clusters(0)})
			if err != nil {
				b.Fatal(err)
			}
			defer a.Close()
			dialer := env.Dialer(broker.Addr, "/kcp")

			b.ResetTimer()
			for i := range b.N {
				from := (i + 1) % 2 // lists from 0 and from 1 in turn
				list := clusters(from)
				newCluster := list[0]
				if from == 1 {
					newCluster = list[n-1]
				}
				if err := a.Reregister(list); err != nil {
					b.Fatal(err)
				}
				waitRouted(ctx, b, dialer, newCluster)
			}
		})
	}
}

// waitRouted dials cluster until a dial succeeds; a cluster no agent
// serves is refused at once with Unavailable.
func waitRouted(ctx context.Context, b *testing.B, d *kcpplugin.Dialer, cluster string) {
	for {
		c, err := d.DialService(ctx, cluster, benchNamespace, "echo", 80)
		if err == nil {
			c.Close()
			return
		}
		if status.Code(err) != codes.Unavailable {
			b.Fatalf("dialing %s: %v", cluster, err)
		}
	}
}

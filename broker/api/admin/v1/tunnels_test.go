package admin

import (
	"bytes"
	"encoding/json"
	"github.com/kcp-dev/tunnel-broker/broker/admission"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/kcp-dev/tunnel-broker/broker/api/agent/v1"
	dialv1 "github.com/kcp-dev/tunnel-broker/broker/api/dial/v1"
	"github.com/kcp-dev/tunnel-broker/broker/internal/brokertest"
	"github.com/kcp-dev/tunnel-broker/broker/policy"
	"github.com/kcp-dev/tunnel-broker/broker/tunnel"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// ListTunnels over tunnels that a real broker (brokertest: gRPC over mTLS
// on loopback, the dial and agent services) carries, dialed and served by
// hand; and the audit line each leaves when it ends.

const (
	kcpPath   = "/kcp"
	shardPath = "/shard"
	agentPath = "/agent"
)

// logLines are the lines of the broker's log so far.
func logLines(b *testutil.LogBuffer) []string {
	return strings.Split(strings.TrimSpace(b.String()), "\n")
}

type tunnelBroker struct {
	*brokertest.Server
	admin *Service
	log   *testutil.LogBuffer
}

func startTunnelBroker(t *testing.T) *tunnelBroker {
	t.Helper()
	pol := policy.File{
		Agents:  []policy.AgentRule{{ID: brokertest.ID(agentPath).String(), Clusters: []string{"*"}}},
		Callers: []policy.CallerRule{{ID: brokertest.ID(kcpPath).String()}, {ID: brokertest.ID(shardPath).String()}},
	}
	b := &tunnelBroker{log: &testutil.LogBuffer{}}
	table := tunnel.NewTable()
	b.Server = brokertest.Start(t, pol, func(s *brokertest.Server, srv *grpc.Server) {
		dialv1.RegisterService(srv, dialv1.New(dialv1.Config{Admission: admission.New(admission.Config{
			Registry: s.Registry, Policy: s.Policy, Timeout: testutil.WaitLong,
			Tunnels: tunnel.Config{Stopping: s.Stopping, Table: table}, BrokerID: "broker-0",
			Log: slog.New(slog.NewJSONHandler(b.log, nil)),
		})}))
		agentv1.RegisterService(srv, agentv1.New(agentv1.Config{
			Registry: s.Registry, Policy: s.Policy, BrokerID: "broker-0", ProbeEvery: time.Hour, Log: s.Log,
		}))
		b.admin = New(Config{Registry: s.Registry, Tunnels: table, BrokerID: "broker-0"})
	})
	return b
}

func (b *tunnelBroker) listTunnels(t *testing.T, req *tunnelv1.ListTunnelsRequest) *tunnelv1.ListTunnelsResponse {
	t.Helper()
	resp, err := b.admin.ListTunnels(t.Context(), req)
	if err != nil {
		t.Fatalf("ListTunnels(%v): %v", req, err)
	}
	return resp
}

func tunnelIDs(resp *tunnelv1.ListTunnelsResponse) []string {
	var ids []string
	for _, tn := range resp.GetTunnels() {
		ids = append(ids, tn.GetTunnelId())
	}
	return ids
}

func TestListTunnelsListsOpenTunnelsWithWhatTheyCarried(t *testing.T) {
	b := startTunnelBroker(t)
	a := b.ConnectAgent(t, agentPath, "a", "root", "team-a")
	first := a.Establish(t, kcpPath, brokertest.Target("root"))
	first.Up("abc")
	first.Down("hello")
	a.Establish(t, shardPath, brokertest.Target("team-a"))
	a.Establish(t, kcpPath, brokertest.Target("team-a"))

	all := b.listTunnels(t, &tunnelv1.ListTunnelsRequest{})
	if len(all.GetTunnels()) != 3 || all.GetNextPageToken() != "" || all.GetBrokerId() != "broker-0" {
		t.Fatalf("listed %d tunnels (next page %q) of %q, want all 3 of broker-0", len(all.GetTunnels()), all.GetNextPageToken(), all.GetBrokerId())
	}
	if ids := tunnelIDs(all); !slices.IsSorted(ids) {
		t.Errorf("tunnels %v, want them by id", ids)
	}
	i := slices.IndexFunc(all.GetTunnels(), func(x *tunnelv1.TunnelInfo) bool { return x.GetBytesUp() > 0 })
	if i < 0 {
		t.Fatal("no tunnel has carried bytes up")
	}
	got := all.GetTunnels()[i]
	if got.GetBytesUp() != 3 || got.GetBytesDown() != 5 || got.GetCallerSpiffeId() != brokertest.ID(kcpPath).String() ||
		got.GetTarget().GetCluster() != "root" || got.GetAgentName() != "a" || got.GetAgentSpiffeId() != brokertest.ID(agentPath).String() ||
		got.GetBrokerId() != "broker-0" || got.GetEstablished() == nil || got.GetAge() == nil || got.GetIdle() == nil || len(got.GetTunnelId()) != 16 {
		t.Errorf("the first tunnel is listed as %v", got)
	}

	byCluster := b.listTunnels(t, &tunnelv1.ListTunnelsRequest{Cluster: "team-a"})
	byCaller := b.listTunnels(t, &tunnelv1.ListTunnelsRequest{CallerSpiffeId: brokertest.ID(kcpPath).String()})
	both := b.listTunnels(t, &tunnelv1.ListTunnelsRequest{Cluster: "team-a", CallerSpiffeId: brokertest.ID(shardPath).String()})
	if len(byCluster.GetTunnels()) != 2 || len(byCaller.GetTunnels()) != 2 || len(both.GetTunnels()) != 1 {
		t.Errorf("filters listed %d by cluster, %d by caller, %d by both; want 2, 2, 1",
			len(byCluster.GetTunnels()), len(byCaller.GetTunnels()), len(both.GetTunnels()))
	}

	page1 := b.listTunnels(t, &tunnelv1.ListTunnelsRequest{PageSize: 2})
	page2 := b.listTunnels(t, &tunnelv1.ListTunnelsRequest{PageSize: 2, PageToken: page1.GetNextPageToken()})
	if paged := append(tunnelIDs(page1), tunnelIDs(page2)...); !slices.Equal(paged, tunnelIDs(all)) || page2.GetNextPageToken() != "" {
		t.Errorf("pages of 2 listed %v (next %q), want %v", paged, page2.GetNextPageToken(), tunnelIDs(all))
	}

	first.CloseBoth()
	testutil.Eventually(t, "the ended tunnel to leave the listing", func() bool {
		return len(b.listTunnels(t, &tunnelv1.ListTunnelsRequest{}).GetTunnels()) == 2
	})
}

func TestListTunnelsRefusesBadRequests(t *testing.T) {
	b := startTunnelBroker(t)
	for _, tc := range []struct {
		req  *tunnelv1.ListTunnelsRequest
		want string
	}{
		{&tunnelv1.ListTunnelsRequest{PageSize: MaxPageSize + 1}, "page_size 1001 is over 1000, the most a page holds"},
		{&tunnelv1.ListTunnelsRequest{CallerSpiffeId: "not an id"}, "caller_spiffe_id: "},
		{&tunnelv1.ListTunnelsRequest{PageToken: "zz"}, "page_token is not a tunnel id: pass a response's next_page_token"},
		{&tunnelv1.ListTunnelsRequest{Cluster: "Not/A/Cluster"}, "cluster: "},
	} {
		_, err := b.admin.ListTunnels(t.Context(), tc.req)
		if s, _ := status.FromError(err); s.Code() != codes.InvalidArgument || !bytes.HasPrefix([]byte(s.Message()), []byte(tc.want)) {
			t.Errorf("ListTunnels(%v): %v, want InvalidArgument %q...", tc.req, err, tc.want)
		}
	}
}

func TestEveryTunnelLeavesOneAuditLineWhenItEnds(t *testing.T) {
	b := startTunnelBroker(t)
	a := b.ConnectAgent(t, agentPath, "a", "root")
	tn := a.Establish(t, kcpPath, brokertest.Target("root"))
	tn.Up("abcd")
	tn.Down("hi")
	tn.CloseBoth()
	var audit map[string]any
	testutil.Eventually(t, "the audit line", func() bool {
		for _, line := range logLines(b.log) {
			var entry struct {
				Level, Msg string
				Audit      map[string]any
			}
			if json.Unmarshal([]byte(line), &entry) == nil && entry.Msg == admission.AuditMessage && entry.Level == "INFO" {
				audit = entry.Audit
				return true
			}
		}
		return false
	})
	want := map[string]any{
		"caller": brokertest.ID(kcpPath).String(), "cluster": "root", "namespace": "default", "service": "webhook",
		"port": 443.0, "agent": "a", "agent_id": brokertest.ID(agentPath).String(), "broker": "broker-0",
		"bytes_up": 4.0, "bytes_down": 2.0, "code": "OK",
	}
	for k, v := range want {
		if audit[k] != v {
			t.Errorf("audit %s = %v, want %v", k, audit[k], v)
		}
	}
	if _, err := time.Parse(time.RFC3339Nano, audit["start"].(string)); err != nil {
		t.Errorf("audit start %v: %v", audit["start"], err)
	}
	if d, ok := audit["duration_s"].(float64); !ok || d < 0 {
		t.Errorf("audit duration_s %v", audit["duration_s"])
	}
	if id, _ := audit["tunnel"].(string); !validPageToken(id) || id == "" {
		t.Errorf("audit tunnel %v", audit["tunnel"])
	}
}

package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// fakeAdmin answers ListAgents with agents and ListTunnels with tunnels
// numbered 0..tunnels-1, a page at a time as the broker does.
type fakeAdmin struct {
	tunnelv1.UnimplementedAdminServiceServer
	agents, tunnels int
	pages           int
}

func (f *fakeAdmin) ListAgents(context.Context, *tunnelv1.ListAgentsRequest) (*tunnelv1.ListAgentsResponse, error) {
	resp := &tunnelv1.ListAgentsResponse{BrokerId: "broker-0"}
	for i := range f.agents {
		resp.Agents = append(resp.Agents, &tunnelv1.AgentInfo{Name: fmt.Sprintf("agent-%d", i), ConnectedSince: timestamppb.Now()})
	}
	return resp, nil
}

func (f *fakeAdmin) ListTunnels(_ context.Context, req *tunnelv1.ListTunnelsRequest) (*tunnelv1.ListTunnelsResponse, error) {
	f.pages++
	first := 0
	if req.GetPageToken() != "" {
		fmt.Sscanf(req.GetPageToken(), "%x", &first)
		first++
	}
	resp := &tunnelv1.ListTunnelsResponse{BrokerId: "broker-0"}
	last := min(first+int(req.GetPageSize()), f.tunnels)
	for i := first; i < last; i++ {
		resp.Tunnels = append(resp.Tunnels, &tunnelv1.TunnelInfo{TunnelId: fmt.Sprintf("%016x", i), Target: &tunnelv1.Target{Cluster: "root"}})
	}
	if last < f.tunnels {
		resp.NextPageToken = fmt.Sprintf("%016x", last-1)
	}
	return resp, nil
}

func serveFake(t *testing.T, f *fakeAdmin) *grpc.ClientConn {
	t.Helper()
	l := bufconn.Listen(1 << 20)
	srv := grpc.NewServer()
	tunnelv1.RegisterAdminServiceServer(srv, f)
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("passthrough:///fake", grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return l.DialContext(ctx) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestAgentsCountsInWords(t *testing.T) {
	for n, want := range map[int]string{0: "broker replica broker-0: 0 agents\n", 1: "broker replica broker-0: 1 agent\n", 2: "broker replica broker-0: 2 agents\n"} {
		var out bytes.Buffer
		if err := listAgents(t.Context(), serveFake(t, &fakeAdmin{agents: n}), "", &out); err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(out.String(), want) {
			t.Errorf("%d agents: %q, want it to start %q", n, out.String(), want)
		}
	}
}

// tunnels reads every page up to --limit, and its header says when the
// limit cut the list.
func TestTunnelsSaysWhenTheLimitCutTheList(t *testing.T) {
	for _, tc := range []struct {
		open, limit int
		header      string
		rows, pages int
	}{
		{1, 10, "broker replica broker-0: 1 tunnel\n", 1, 1},
		{0, 10, "broker replica broker-0: 0 tunnels\n", 0, 1},
		{3, 3, "broker replica broker-0: 3 tunnels\n", 3, 1},
		{4, 3, "broker replica broker-0: 3 tunnels (more are open: --limit 3 cut the list)\n", 3, 1},
		{2500, 10000, "broker replica broker-0: 2500 tunnels\n", 2500, 3},
		{2500, 1500, "broker replica broker-0: 1500 tunnels (more are open: --limit 1500 cut the list)\n", 1500, 2},
		{2000, 2000, "broker replica broker-0: 2000 tunnels\n", 2000, 2},
	} {
		f := &fakeAdmin{tunnels: tc.open}
		var out bytes.Buffer
		if err := listTunnels(t.Context(), serveFake(t, f), &tunnelv1.ListTunnelsRequest{}, tc.limit, false, &out); err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
		if !strings.HasPrefix(out.String(), tc.header) || len(lines)-2 != tc.rows || f.pages != tc.pages {
			t.Errorf("%d open, --limit %d: %q... with %d rows in %d pages; want %q with %d rows in %d pages",
				tc.open, tc.limit, lines[0], len(lines)-2, f.pages, tc.header, tc.rows, tc.pages)
		}
	}
}

// A command's mistakes are found before anything is read or dialed, and
// point at the command's --help.
func TestCommandMistakesPointAtTheirHelp(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string // "" for none
	}{
		{"agents", nil, ""},
		{"agents", []string{"--cluster", "root"}, ""},
		{"agents", []string{"--clustr", "root"}, "flag provided but not defined: -clustr"},
		{"agents", []string{"root"}, `unexpected argument "root"`},
		{"tunnels", []string{"--limit", "0"}, "--limit 0: must be positive"},
		{"tunnels", []string{"--limit", "-1"}, "--limit -1: must not be negative"},
		{"dial", []string{"root", "default", "web"}, "dial takes CLUSTER NAMESPACE SERVICE PORT, not 3 arguments"},
		{"dial", []string{"root", "default", "web", "http"}, `port "http" is not a number`},
		{"dial", []string{"root", "default", "web", "80"}, ""},
		{"port-forward", []string{"8080"}, "port-forward takes LOCALPORT CLUSTER/NAMESPACE/SERVICE:PORT, not 1 argument"},
		{"port-forward", []string{"8080", "root/web:80"}, "want CLUSTER/NAMESPACE/SERVICE:PORT"},
	} {
		_, err := brokerCommands[tc.name].parse(tc.name, tc.args)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("%s %v: %v, want %q", tc.name, tc.args, err, tc.want)
			continue
		}
		var fe *flagcheck.FlagError
		if err != nil && (!errors.As(err, &fe) || fe.Help != "tunnelctl "+tc.name+" --help") {
			t.Errorf("%s %v: %v does not point at tunnelctl %s --help", tc.name, tc.args, err, tc.name)
		}
	}
}

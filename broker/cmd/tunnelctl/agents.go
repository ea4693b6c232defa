package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// agents is the agents command: it prints the agents the replica knows, as
// a table.
func agents(fs *flag.FlagSet) func([]string) (runner, error) {
	cluster := fs.String("cluster", "", "only agents that serve this logical cluster (its name, not a path)")
	return func([]string) (runner, error) {
		if err := flagcheck.Check(fs); err != nil {
			return nil, err
		}
		return func(ctx context.Context, conn *grpc.ClientConn) error {
			return listAgents(ctx, conn, *cluster, os.Stdout)
		}, nil
	}
}

func listAgents(ctx context.Context, conn *grpc.ClientConn, cluster string, out io.Writer) error {
	resp, err := tunnelv1.NewAdminServiceClient(conn).ListAgents(ctx, &tunnelv1.ListAgentsRequest{Cluster: cluster})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "broker replica %s: %s\n", resp.GetBrokerId(), plural(len(resp.GetAgents()), "agent"))
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "NAME\tSPIFFE ID\tCLUSTERS\tTUNNELS\tCONNECTED\tLAST PROBE\tRTT\tSTATE")
	for _, a := range resp.GetAgents() {
		probe, rtt := "never", "-"
		if a.GetLastProbe() != nil {
			probe = time.Since(a.GetLastProbe().AsTime()).Round(time.Second).String() + " ago"
			rtt = a.GetLastProbeRtt().AsDuration().Round(time.Microsecond).String()
		}
		state := "serving"
		if a.GetDraining() {
			state = "draining"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%s\n", a.GetName(), a.GetSpiffeId(),
			strings.Join(a.GetClusters(), ","), a.GetActiveTunnels(),
			time.Since(a.GetConnectedSince().AsTime()).Round(time.Second).String()+" ago", probe, rtt, state)
	}
	return w.Flush()
}

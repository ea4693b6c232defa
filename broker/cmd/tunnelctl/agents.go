package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// agents prints the agents the replica knows, as a table.
func agents(ctx context.Context, conn *grpc.ClientConn, args []string) error {
	fs := flag.NewFlagSet("agents", flag.ContinueOnError)
	cluster := fs.String("cluster", "", "only agents that serve this logical cluster")
	if err := fs.Parse(args); err != nil {
		return err
	}
	resp, err := tunnelv1.NewAdminServiceClient(conn).ListAgents(ctx, &tunnelv1.ListAgentsRequest{Cluster: *cluster})
	if err != nil {
		return err
	}
	fmt.Printf("broker replica %s: %d agents\n", resp.GetBrokerId(), len(resp.GetAgents()))
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
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

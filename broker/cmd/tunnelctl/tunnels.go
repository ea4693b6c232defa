package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// tunnels prints the tunnels open through the replica, as a table, reading
// the listing a page at a time.
func tunnels(ctx context.Context, conn *grpc.ClientConn, args []string) error {
	fs := flag.NewFlagSet("tunnels", flag.ContinueOnError)
	cluster := fs.String("cluster", "", "only tunnels to this logical cluster")
	caller := fs.String("caller", "", "only tunnels of this caller SPIFFE ID")
	limit := fs.Int("limit", 10000, "print at most this many tunnels")
	if err := fs.Parse(args); err != nil {
		return err
	}
	client := tunnelv1.NewAdminServiceClient(conn)
	req := &tunnelv1.ListTunnelsRequest{Cluster: *cluster, CallerSpiffeId: *caller, PageSize: 1000}
	var listed []*tunnelv1.TunnelInfo
	var replica string
	for len(listed) < *limit {
		resp, err := client.ListTunnels(ctx, req)
		if err != nil {
			return err
		}
		replica = resp.GetBrokerId()
		listed = append(listed, resp.GetTunnels()...)
		if req.PageToken = resp.GetNextPageToken(); req.PageToken == "" {
			break
		}
	}
	listed = listed[:min(len(listed), *limit)]
	fmt.Printf("broker replica %s: %d tunnels\n", replica, len(listed))
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "TUNNEL\tCALLER\tTARGET\tAGENT\tAGE\tUP\tDOWN\tIDLE")
	for _, t := range listed {
		tg := t.GetTarget()
		fmt.Fprintf(w, "%s\t%s\t%s/%s/%s:%d\t%s\t%s\t%d\t%d\t%s\n", t.GetTunnelId(), t.GetCallerSpiffeId(),
			tg.GetCluster(), tg.GetNamespace(), tg.GetService(), tg.GetPort(), t.GetAgentName(),
			t.GetAge().AsDuration().Round(time.Second), t.GetBytesUp(), t.GetBytesDown(),
			t.GetIdle().AsDuration().Round(time.Second))
	}
	return w.Flush()
}

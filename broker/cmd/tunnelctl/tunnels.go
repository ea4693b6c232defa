package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// tunnels is the tunnels command: it prints the tunnels open through the
// replica, as a table.
func tunnels(fs *flag.FlagSet) func([]string) (runner, error) {
	cluster := fs.String("cluster", "", "only tunnels to this logical cluster (its name, not a path)")
	caller := fs.String("caller", "", "only tunnels of this caller SPIFFE ID")
	limit := fs.Int("limit", 10000, "print at most this many tunnels, the first by tunnel id; the header says when more are open")
	traces := fs.Bool("trace-ids", false, "add a TRACE column: the OpenTelemetry trace of each tunnel (- when it has none)")
	return func([]string) (runner, error) {
		if err := flagcheck.Check(fs, "limit"); err != nil {
			return nil, err
		}
		req := &tunnelv1.ListTunnelsRequest{Cluster: *cluster, CallerSpiffeId: *caller}
		return func(ctx context.Context, conn *grpc.ClientConn) error {
			return listTunnels(ctx, conn, req, *limit, *traces, os.Stdout)
		}, nil
	}
}

// maxPageSize is the most tunnels a page of ListTunnels holds.
const maxPageSize = 1000

// listTunnels prints the tunnels req selects, at most limit of them,
// reading the listing a page at a time; its header says when the limit cut
// the list. traces adds each tunnel's trace id.
func listTunnels(ctx context.Context, conn *grpc.ClientConn, req *tunnelv1.ListTunnelsRequest, limit int, traces bool, out io.Writer) error {
	client := tunnelv1.NewAdminServiceClient(conn)
	var listed []*tunnelv1.TunnelInfo
	var replica string
	for {
		req.PageSize = uint32(min(limit-len(listed), maxPageSize))
		resp, err := client.ListTunnels(ctx, req)
		if err != nil {
			return err
		}
		replica = resp.GetBrokerId()
		listed = append(listed, resp.GetTunnels()...)
		// A next page, when the limit is reached, is what the limit cut.
		if req.PageToken = resp.GetNextPageToken(); req.PageToken == "" || len(listed) >= limit {
			break
		}
	}
	listed = listed[:min(len(listed), limit)]
	header := fmt.Sprintf("broker replica %s: %s", replica, plural(len(listed), "tunnel"))
	if req.PageToken != "" {
		header += fmt.Sprintf(" (more are open: --limit %d cut the list)", limit)
	}
	fmt.Fprintln(out, header)
	w := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	columns := "TUNNEL\tCALLER\tTARGET\tAGENT\tAGE\tUP\tDOWN\tIDLE"
	if traces {
		columns += "\tTRACE"
	}
	fmt.Fprintln(w, columns)
	for _, t := range listed {
		tg := t.GetTarget()
		fmt.Fprintf(w, "%s\t%s\t%s/%s/%s:%d\t%s\t%s\t%d\t%d\t%s", t.GetTunnelId(), t.GetCallerSpiffeId(),
			tg.GetCluster(), tg.GetNamespace(), tg.GetService(), tg.GetPort(), t.GetAgentName(),
			t.GetAge().AsDuration().Round(time.Second), t.GetBytesUp(), t.GetBytesDown(),
			t.GetIdle().AsDuration().Round(time.Second))
		if traces {
			fmt.Fprintf(w, "\t%s", cmp.Or(t.GetTraceId(), "-"))
		}
		fmt.Fprintln(w)
	}
	return w.Flush()
}

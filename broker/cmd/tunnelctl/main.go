// Command tunnelctl is for people: list the agents a broker replica knows,
// open a tunnel on stdin/stdout like nc, or forward a local port to a
// Service in a logical cluster like kubectl port-forward. It uses kcpplugin,
// as kcp does, with the operator's SPIFFE identity.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/internal/version"
)

const usage = `tunnelctl talks to a tunnel broker replica with a SPIFFE identity.

Usage:
  tunnelctl [flags] agents [--cluster NAME]
  tunnelctl [flags] tunnels [--cluster NAME] [--caller SPIFFE_ID] [--limit N]
  tunnelctl [flags] dial CLUSTER NAMESPACE SERVICE PORT
  tunnelctl [flags] port-forward LOCALPORT CLUSTER/NAMESPACE/SERVICE:PORT

Flags:
`

func main() {
	err := run()
	if err != nil {
		fmt.Fprintln(os.Stderr, "tunnelctl:", explain(err))
		os.Exit(1)
	}
}

func run() error {
	fs := flag.NewFlagSet("tunnelctl", flag.ContinueOnError)
	broker := fs.String("broker", "localhost:8443", "broker replica address, host:port")
	brokerID := fs.String("broker-spiffe-id", "", "SPIFFE ID the broker must present (default: any in your trust domain)")
	idOpts := identity.AddFlags(fs)
	showVer := fs.Bool("version", false, "print the version and exit")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if *showVer {
		fmt.Println("tunnelctl", version.Get())
		return nil
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return errors.New("no command")
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	conn, err := connect(ctx, *broker, *brokerID, idOpts)
	if err != nil {
		return err
	}
	defer conn.Close()

	cmd, args := fs.Arg(0), fs.Args()[1:]
	switch cmd {
	case "agents":
		return agents(ctx, conn, args)
	case "tunnels":
		return tunnels(ctx, conn, args)
	case "dial":
		return dial(ctx, conn, args)
	case "port-forward":
		return portForward(ctx, conn, args)
	default:
		return fmt.Errorf("unknown command %q (agents, tunnels, dial, port-forward)", cmd)
	}
}

// connect makes the gRPC connection to the broker with the operator's SVID.
func connect(ctx context.Context, addr, brokerID string, o *identity.Options) (*grpc.ClientConn, error) {
	src, err := identity.Open(ctx, *o, nil)
	if err != nil {
		return nil, err
	}
	self, err := identity.IDOf(src)
	if err != nil {
		return nil, err
	}
	authorize := tlsconfig.AuthorizeMemberOf(self.TrustDomain())
	if brokerID != "" {
		id, err := spiffeid.FromString(brokerID)
		if err != nil {
			return nil, fmt.Errorf("--broker-spiffe-id: %w", err)
		}
		authorize = tlsconfig.AuthorizeID(id)
	}
	return grpc.NewClient(addr, grpc.WithTransportCredentials(identity.ClientCredentials(src, authorize)))
}

// explain adds what a person can do about a broker's status.
func explain(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return err.Error()
	}
	hint := map[codes.Code]string{
		codes.InvalidArgument:   "check the cluster name (not a path), namespace, service and port",
		codes.Unavailable:       "no agent can reach it now: is the syncer agent of that cluster running and registered (tunnelctl agents)? Or the broker is unreachable",
		codes.NotFound:          "the agent knows no such Service or port in that namespace",
		codes.DeadlineExceeded:  "the agent did not connect in time: is the Service's endpoint up?",
		codes.PermissionDenied:  "your SPIFFE ID is not allowed this by the broker's policy",
		codes.ResourceExhausted: "a limit was hit; try again later",
		codes.Unauthenticated:   "the broker did not see a SPIFFE identity",
	}[st.Code()]
	if hint == "" {
		return fmt.Sprintf("%s: %s", st.Code(), st.Message())
	}
	return fmt.Sprintf("%s: %s\n  (%s)", st.Code(), st.Message(), hint)
}

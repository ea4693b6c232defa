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
	"strings"
	"syscall"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
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
  tunnelctl dev-ca [--trust-domain NAME] DIR   (a throwaway trust domain, to run the parts by hand)

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

	cmd, args := fs.Arg(0), fs.Args()[1:]
	if cmd == "dev-ca" {
		return devCA(args, os.Stdout)
	}
	brokerCmd, ok := brokerCommands[cmd]
	if !ok {
		return fmt.Errorf("unknown command %q (agents, tunnels, dial, port-forward, dev-ca)", cmd)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	conn, err := connect(ctx, *broker, *brokerID, idOpts)
	if err != nil {
		return err
	}
	defer conn.Close()
	return brokerCmd(ctx, conn, args)
}

// brokerCommands are the commands that talk to a broker replica.
var brokerCommands = map[string]func(context.Context, *grpc.ClientConn, []string) error{
	"agents":       agents,
	"tunnels":      tunnels,
	"dial":         dial,
	"port-forward": portForward,
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
	authorize := identity.AuthorizeMemberOf(self.TrustDomain(), "tunnelctl (the trust domain of its own SVID, without --broker-spiffe-id)")
	if brokerID != "" {
		id, err := spiffeid.FromString(brokerID)
		if err != nil {
			return nil, fmt.Errorf("--broker-spiffe-id: %w", err)
		}
		authorize = identity.AuthorizeID(id, "--broker-spiffe-id")
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
		codes.Unavailable:       unavailableHint(st.Message()),
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

// unavailableHint tells apart the three reasons for Unavailable: the
// broker cannot be reached, the TLS handshake with it failed, or the broker
// answered that no agent can reach the Service.
func unavailableHint(msg string) string {
	switch {
	case strings.Contains(msg, "authentication handshake failed"):
		return "the TLS handshake with the broker failed: check --broker-spiffe-id, that your --trust-bundle holds the broker's CA, and the broker's log for why it refused you"
	case strings.Contains(msg, "connection error"), strings.Contains(msg, "while dialing"):
		return "the broker is not reachable at --broker: is it running and listening there?"
	}
	return "no agent can reach it now: is the syncer agent of that cluster running and registered (tunnelctl agents)?"
}

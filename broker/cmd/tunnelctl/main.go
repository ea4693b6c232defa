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
	"google.golang.org/grpc"

	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
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
  tunnelctl help [COMMAND]                     (or tunnelctl COMMAND --help)

Flags:
`

func main() {
	err := run()
	var fe *flagcheck.FlagError
	if err == nil || errors.Is(err, flag.ErrHelp) || errors.As(err, &fe) {
		os.Exit(flagcheck.Report(os.Stderr, "tunnelctl", err))
	}
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
	if err := flagcheck.Parse(fs, os.Args[1:], os.Stdout); err != nil {
		return err
	}
	if *showVer {
		fmt.Println("tunnelctl", version.Get())
		return nil
	}
	if fs.NArg() == 0 {
		return flagcheck.Errorf("no command: give one of agents, tunnels, dial, port-forward, dev-ca")
	}

	name, args := fs.Arg(0), fs.Args()[1:]
	switch name {
	case "dev-ca":
		return devCA(args, os.Stdout)
	case "help":
		return help(fs, args)
	}
	cmd, ok := brokerCommands[name]
	if !ok {
		return flagcheck.Errorf("unknown command %q (agents, tunnels, dial, port-forward, dev-ca, help)", name)
	}
	// The command's flags and arguments are checked before anything is
	// read or dialed.
	runCmd, err := cmd.parse(name, args)
	if err != nil {
		return err
	}
	if err := flagcheck.HostPort("broker", *broker); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	conn, err := connect(ctx, *broker, *brokerID, idOpts)
	if err != nil {
		return err
	}
	defer conn.Close()
	return runCmd(ctx, conn)
}

// help prints the usage of tunnelctl, or of the command args names.
func help(fs *flag.FlagSet, args []string) error {
	switch {
	case len(args) == 0:
		fs.SetOutput(os.Stdout)
		fs.Usage()
		return nil
	case len(args) > 1:
		return flagcheck.Errorf("help takes one command at most, not %d", len(args))
	case args[0] == "dev-ca":
		return devCA([]string{"--help"}, os.Stdout)
	}
	cmd, ok := brokerCommands[args[0]]
	if !ok {
		return flagcheck.Errorf("help: unknown command %q (agents, tunnels, dial, port-forward, dev-ca)", args[0])
	}
	cmdFlags := cmd.flagSet(args[0])
	cmd.setup(cmdFlags)
	cmdFlags.SetOutput(os.Stdout)
	cmdFlags.Usage()
	return nil
}

// command is a command that talks to a broker replica.
type command struct {
	// synopsis is how to call it, after "tunnelctl [flags] ", and about
	// what it does.
	synopsis, about string
	// setup adds the command's flags to fs and returns what checks its
	// arguments, after fs is parsed, and runs it on a connection.
	setup func(fs *flag.FlagSet) func(args []string) (runner, error)
}

// runner runs a command whose flags and arguments are checked.
type runner func(ctx context.Context, conn *grpc.ClientConn) error

// flagSet is the command's flags, whose usage says how to call it.
func (c command) flagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "%s\n\nUsage:\n  tunnelctl [flags] %s\n", c.about, c.synopsis)
		if hasFlags(fs) {
			fmt.Fprintln(fs.Output(), "\nFlags:")
			fs.PrintDefaults()
		}
		fmt.Fprintln(fs.Output(), "\nThe flags before the command (--broker, the SVID's) are in tunnelctl --help.")
	}
	return fs
}

// parse parses the command's flags and checks its arguments: a mistake is
// a FlagError pointing at the command's --help.
func (c command) parse(name string, args []string) (runner, error) {
	fs := c.flagSet(name)
	check := c.setup(fs)
	err := flagcheck.Parse(fs, args, os.Stdout)
	var r runner
	if err == nil {
		r, err = check(fs.Args())
	}
	var fe *flagcheck.FlagError
	if errors.As(err, &fe) {
		fe.Help = "tunnelctl " + name + " --help"
	}
	return r, err
}

func hasFlags(fs *flag.FlagSet) bool {
	n := 0
	fs.VisitAll(func(*flag.Flag) { n++ })
	return n > 0
}

// brokerCommands are the commands that talk to a broker replica.
var brokerCommands = map[string]command{
	"agents": {"agents [--cluster NAME]", "Lists the agents the broker replica knows, with the logical clusters they serve.", agents},
	"tunnels": {"tunnels [--cluster NAME] [--caller SPIFFE_ID] [--limit N]",
		"Lists the tunnels open through the broker replica, from both front ends, by tunnel id.", tunnels},
	"dial": {"dial CLUSTER NAMESPACE SERVICE PORT",
		"Opens a tunnel to a Service port and pipes stdin and stdout through it, like nc.", dial},
	"port-forward": {"port-forward LOCALPORT CLUSTER/NAMESPACE/SERVICE:PORT",
		"Forwards 127.0.0.1:LOCALPORT to a Service port, a tunnel per connection, like kubectl port-forward.", portForward},
}

// plural is n and noun, with an s unless n is 1.
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
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
	presented = src
	authorize := identity.AuthorizeMemberOf(self.TrustDomain(), "tunnelctl (the trust domain of its own SVID, without --broker-spiffe-id)")
	if brokerID != "" {
		id, err := spiffeid.FromString(brokerID)
		if err != nil {
			return nil, fmt.Errorf("--broker-spiffe-id: %w", err)
		}
		authorize = identity.AuthorizeID(id, "--broker-spiffe-id")
	}
	// Its own dialer and credentials see why a connection failed, by type
	// (hints.go); passthrough leaves the name to the dialer, whose
	// net.DNSError says when it does not resolve.
	return grpc.NewClient("passthrough:///"+addr, grpc.WithContextDialer(dialBroker),
		grpc.WithTransportCredentials(recordingCreds{identity.ClientCredentials(src, authorize)}))
}

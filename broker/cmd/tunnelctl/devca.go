package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
)

// devIdentity is one workload of the throwaway trust domain dev-ca writes:
// its folder under DIR and the path of its SPIFFE ID.
type devIdentity struct {
	dir, path, role string
}

// devIdentities are the four workloads a person needs to run everything by
// hand: the agent's ID fits the policy's {syncTarget} template for the sync
// target "dev".
var devIdentities = []devIdentity{
	{"broker", "/broker", "the broker (DNS SAN localhost, IP SAN 127.0.0.1, for grpcurl)"},
	{"agent", "/agent/dev", "a syncer-agent, sync target dev, serving logical cluster root"},
	{"kcp", "/kcp", "kcp: may call Dial"},
	{"operator", "/operator", "an operator: may call Dial and the admin RPCs (tunnelctl), and CONNECT to root"},
}

// devPolicy is the broker's policy for the dev identities.
const devPolicy = `# Written by tunnelctl dev-ca: the policy of a throwaway trust domain.
agents:
- id: spiffe://%[1]s/agent/{syncTarget}
syncTargets:
  dev: [root]
callers:
- id: spiffe://%[1]s/kcp
- id: spiffe://%[1]s/operator
operators:
- id: spiffe://%[1]s/operator
egress:                 # the CONNECT front end (broker --egress-listen), as curl -p
- id: spiffe://%[1]s/operator
  cluster: root
`

// devServices is the agent's static Service table: one Service in logical
// cluster root, served by whatever listens on 127.0.0.1:8080.
const devServices = `# Written by tunnelctl dev-ca: the agent's Services (syncer-agent --services).
services:
- cluster: root
  namespace: default
  name: web
  ports:
    "80": 127.0.0.1:8080
`

// devCA is the dev-ca command: it writes a throwaway SPIFFE trust domain
// (a CA, an SVID per workload as csi-driver-spiffe names them, a policy and
// a Service table) into a new folder, for running the parts by hand.
func devCA(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("dev-ca", flag.ContinueOnError)
	fs.SetOutput(out)
	td := fs.String("trust-domain", "example.org", "the trust domain's name")
	fs.Usage = func() {
		fmt.Fprintln(out, "Usage: tunnelctl dev-ca [--trust-domain NAME] DIR\n\nWrites a throwaway trust domain (valid 24 hours) into DIR, which must not exist yet or be empty:")
		fs.PrintDefaults()
	}
	err := flagcheck.Parse(fs, args, out)
	switch {
	case err != nil:
	case fs.NArg() != 1:
		err = flagcheck.Errorf("dev-ca takes one argument, the folder to write, not %d", fs.NArg())
	default:
		if _, tdErr := spiffeid.TrustDomainFromString(*td); tdErr != nil {
			err = flagcheck.Errorf("--trust-domain: %w", tdErr)
		}
	}
	if fe := (*flagcheck.FlagError)(nil); errors.As(err, &fe) {
		fe.Help = "tunnelctl dev-ca --help"
	}
	if err != nil {
		return err
	}
	dir := fs.Arg(0)
	if err := newFolder(dir); err != nil {
		return err
	}
	if err := writeDevTrustDomain(dir, *td); err != nil {
		return err
	}
	printDevTrustDomain(out, dir, *td)
	return nil
}

// newFolder makes dir, which must not exist or be empty: dev-ca never
// overwrites a trust domain that something may still use.
func newFolder(dir string) error {
	entries, err := os.ReadDir(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return os.MkdirAll(dir, 0o700)
	case err != nil:
		return err
	case len(entries) > 0:
		return fmt.Errorf("%s is not empty: dev-ca writes a new trust domain only into an empty or new folder", dir)
	}
	return nil
}

// writeDevTrustDomain writes DIR/ca.crt, DIR/<workload>/{tls.crt,tls.key,ca.crt},
// DIR/policy.yaml and DIR/services.yaml.
func writeDevTrustDomain(dir, trustDomain string) error {
	ca, err := devca.New(trustDomain+" dev CA (tunnelctl dev-ca)", trustDomain)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), ca.BundlePEM(), 0o644); err != nil {
		return err
	}
	for _, w := range devIdentities {
		leaf := devca.Leaf{SPIFFEID: w.path}
		if w.dir == "broker" {
			leaf.DNSNames, leaf.IPs = []string{"localhost"}, []net.IP{net.IPv4(127, 0, 0, 1)}
		}
		if _, err := ca.WriteSVID(filepath.Join(dir, w.dir), leaf); err != nil {
			return fmt.Errorf("writing the SVID of %s: %w", w.dir, err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "policy.yaml"), fmt.Appendf(nil, devPolicy, trustDomain), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "services.yaml"), []byte(devServices), 0o644)
}

func printDevTrustDomain(out io.Writer, dir, trustDomain string) {
	var b strings.Builder
	fmt.Fprintf(&b, "throwaway trust domain spiffe://%s, valid 24 hours, in %s:\n", trustDomain, dir)
	fmt.Fprintf(&b, "  %-22s the trust bundle (also in each SVID's folder)\n", filepath.Join(dir, "ca.crt"))
	for _, w := range devIdentities {
		fmt.Fprintf(&b, "  %-22s spiffe://%s%s, %s\n", filepath.Join(dir, w.dir)+"/tls.{crt,key}", trustDomain, w.path, w.role)
	}
	fmt.Fprintf(&b, "  %-22s the broker's --policy for them\n", filepath.Join(dir, "policy.yaml"))
	fmt.Fprintf(&b, "  %-22s the agent's --services: root/default/web:80 -> 127.0.0.1:8080\n", filepath.Join(dir, "services.yaml"))
	fmt.Fprint(out, b.String())
}

package identity

import (
	"flag"
	"strings"
	"time"
)

// AddFlags registers the identity flags every binary shares and returns the
// options they fill.
func AddFlags(fs *flag.FlagSet) *Options {
	o := &Options{}
	fs.StringVar(&o.Socket, "spiffe-socket", "", "SPIFFE Workload API address, e.g. unix:///run/spire/agent.sock (default $SPIFFE_ENDPOINT_SOCKET, unless SVID files are given)")
	fs.StringVar(&o.Files.Cert, "svid-cert", "", "X.509-SVID certificate chain file (PEM, leaf first), instead of the Workload API")
	fs.StringVar(&o.Files.Key, "svid-key", "", "X.509-SVID private key file (PEM, PKCS#8)")
	fs.StringVar(&o.Files.Bundle, "trust-bundle", "", "trust bundle file of the SVID's own trust domain (PEM)")
	fs.Var((*federatedFlag)(o), "federated-bundle", "TRUST_DOMAIN=FILE: also trust peers of another trust domain (repeatable; with SVID files)")
	fs.DurationVar(&o.WorkloadAPITimeout, "workload-api-timeout", DefaultWorkloadAPITimeout, "how long to wait at start for the first X.509-SVID from the Workload API before giving up")
	fs.DurationVar(&o.Reload, "svid-reload-interval", 5*time.Second, "how often SVID files are re-read for rotation (and the agent looks whether its SVID rotated)")
	return o
}

type federatedFlag Options

func (f *federatedFlag) String() string {
	var parts []string
	for td, path := range f.Files.Federated {
		parts = append(parts, td+"="+path)
	}
	return strings.Join(parts, ",")
}

func (f *federatedFlag) Set(v string) error {
	m, err := ParseFederated([]string{v})
	if err != nil {
		return err
	}
	if f.Files.Federated == nil {
		f.Files.Federated = map[string]string{}
	}
	for td, path := range m {
		f.Files.Federated[td] = path
	}
	return nil
}

// Package tunnel fills kcp's webhook seam with kcpplugin from flags: kcp's
// SVID from the SPIFFE Workload API or from files that rotate, one
// connection to the broker replicas, and a kcpplugin wrapper per logical
// cluster. It does not import kcp, so it is tested on its own.
package tunnel

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/spf13/pflag"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
)

// Options are the --tunnel-* flags.
type Options struct {
	// Broker is the broker replicas' gRPC target; empty: no tunnel.
	Broker string
	// BrokerID is the SPIFFE ID the broker must present; empty: any ID
	// of kcp's own trust domain.
	BrokerID string
	// SPIFFESocket is the Workload API address kcp's SVID comes from.
	SPIFFESocket string
	// SVIDCert, SVIDKey and TrustBundle are PEM files kcp's SVID comes
	// from instead, re-read every FileReload.
	SVIDCert, SVIDKey, TrustBundle string
	// DialTimeout bounds each tunnel's dial.
	DialTimeout time.Duration

	// WorkloadAPITimeout bounds the wait for the first SVID at start.
	WorkloadAPITimeout time.Duration
	// FileReload is how often SVID files are re-read.
	FileReload time.Duration
}

// NewOptions returns the defaults.
func NewOptions() *Options {
	return &Options{
		DialTimeout:        kcpplugin.DefaultDialTimeout,
		WorkloadAPITimeout: 2 * time.Minute,
		FileReload:         5 * time.Second,
	}
}

// AddFlags registers the --tunnel-* flags.
func (o *Options) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.Broker, "tunnel-broker", o.Broker,
		"The tunnel broker replicas' gRPC target, e.g. dns:///tunnel-broker.kcp-system.svc:8443. Webhooks and conversion webhooks "+
			"that name a Service are called through it, for the logical cluster that owns them. Empty: kcp calls them as it always does.")
	fs.StringVar(&o.BrokerID, "tunnel-broker-spiffe-id", o.BrokerID,
		"The SPIFFE ID the broker must present, e.g. spiffe://example.org/ns/kcp-system/sa/tunnel-broker. Empty: any ID of kcp's own trust domain.")
	fs.StringVar(&o.SPIFFESocket, "tunnel-spiffe-socket", o.SPIFFESocket,
		"The SPIFFE Workload API address kcp's X.509-SVID comes from, e.g. unix:///spiffe-workload-api/spire-agent.sock "+
			"(default $SPIFFE_ENDPOINT_SOCKET, unless SVID files are given). The SVID rotates with it.")
	fs.StringVar(&o.SVIDCert, "tunnel-svid-cert", o.SVIDCert, "kcp's X.509-SVID certificate chain file (PEM, leaf first), instead of the Workload API. Re-read when it changes.")
	fs.StringVar(&o.SVIDKey, "tunnel-svid-key", o.SVIDKey, "kcp's X.509-SVID private key file (PEM, PKCS#8).")
	fs.StringVar(&o.TrustBundle, "tunnel-trust-bundle", o.TrustBundle, "The trust bundle file of kcp's trust domain (PEM).")
	fs.DurationVar(&o.DialTimeout, "tunnel-dial-timeout", o.DialTimeout, "How long a webhook call waits for its tunnel, from the dial to a usable connection.")
}

// Validate reports every mistake in the flags.
func (o *Options) Validate() []error {
	files := o.SVIDCert != "" || o.SVIDKey != "" || o.TrustBundle != ""
	if o.Broker == "" {
		if o.BrokerID != "" || o.SPIFFESocket != "" || files {
			return []error{errors.New("--tunnel-broker-spiffe-id, --tunnel-spiffe-socket and the --tunnel-svid-* files need --tunnel-broker")}
		}
		return nil
	}
	var errs []error
	if o.BrokerID != "" {
		if _, err := spiffeid.FromString(o.BrokerID); err != nil {
			errs = append(errs, fmt.Errorf("--tunnel-broker-spiffe-id %q: %w", o.BrokerID, err))
		}
	}
	switch {
	case files && o.SPIFFESocket != "":
		errs = append(errs, errors.New("--tunnel-spiffe-socket and the --tunnel-svid-* files are two sources of kcp's SVID: give one"))
	case files && (o.SVIDCert == "" || o.SVIDKey == "" || o.TrustBundle == ""):
		errs = append(errs, errors.New("SVID files need all three of --tunnel-svid-cert, --tunnel-svid-key and --tunnel-trust-bundle"))
	case !files && o.socket() == "":
		errs = append(errs, errors.New("--tunnel-broker needs kcp's SVID: --tunnel-spiffe-socket (or $SPIFFE_ENDPOINT_SOCKET), or the --tunnel-svid-* files"))
	}
	if o.DialTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--tunnel-dial-timeout %v: must be positive", o.DialTimeout))
	}
	return errs
}

// socket is the Workload API address: the flag, else go-spiffe's variable.
func (o *Options) socket() string {
	if o.SPIFFESocket != "" {
		return o.SPIFFESocket
	}
	if o.SVIDCert != "" {
		return ""
	}
	return os.Getenv("SPIFFE_ENDPOINT_SOCKET")
}

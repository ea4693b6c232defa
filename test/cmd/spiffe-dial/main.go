// Command spiffe-dial is a Dial caller for tests that run it as some user:
// it asks the SPIFFE Workload API for an X.509-SVID, and with one dials a
// Service through the broker with kcpplugin. It prints one line per step
// and exits non-zero when a step fails:
//
//	svid: spiffe://spire.test/x serial 1234 expires 2026-01-02T03:04:05Z
//	dial: OK
//
// or, when a step fails, e.g.
//
//	svid-error: PermissionDenied: no identity issued
//	dial-error: PermissionDenied: ...
//
// Exit codes: 0 all steps worked, 2 no SVID, 3 the dial failed, 1 misuse.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/kcp-dev/tunnel-broker/internal/identity"
	"github.com/kcp-dev/tunnel-broker/kcpplugin"
)

func main() {
	var (
		socket    = flag.String("socket", "", "Workload API address (default $SPIFFE_ENDPOINT_SOCKET)")
		wait      = flag.Duration("wait", 0, "keep asking for an SVID this long (0: ask once)")
		broker    = flag.String("broker", "", "broker address; without it, only fetch the SVID")
		brokerID  = flag.String("broker-spiffe-id", "", "SPIFFE ID the broker must present (default: any in our trust domain)")
		cluster   = flag.String("cluster", "root", "logical cluster")
		namespace = flag.String("namespace", "default", "Service namespace")
		service   = flag.String("service", "", "Service name")
		port      = flag.Int("port", 443, "Service port")
	)
	flag.Parse()
	var opts []workloadapi.ClientOption
	if *socket != "" {
		opts = append(opts, workloadapi.WithAddr(*socket))
	}

	x509ctx, err := fetch(*wait, opts)
	if err != nil {
		fmt.Printf("svid-error: %s: %s\n", status.Code(err), status.Convert(err).Message())
		os.Exit(2)
	}
	svid := x509ctx.DefaultSVID()
	fmt.Printf("svid: %s serial %s expires %s\n", svid.ID, svid.Certificates[0].SerialNumber,
		svid.Certificates[0].NotAfter.UTC().Format(time.RFC3339))
	if *broker == "" {
		return
	}

	authorize := tlsconfig.AuthorizeMemberOf(svid.ID.TrustDomain())
	if *brokerID != "" {
		id, err := spiffeid.FromString(*brokerID)
		if err != nil {
			fmt.Fprintln(os.Stderr, "--broker-spiffe-id:", err)
			os.Exit(1)
		}
		authorize = tlsconfig.AuthorizeID(id)
	}
	src := static{svid, x509ctx.Bundles}
	conn, err := grpc.NewClient(*broker, grpc.WithTransportCredentials(identity.ClientCredentials(src, authorize)))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// The dial waits for its tunnel, so that its outcome is DialService's.
	dialer := kcpplugin.NewDialer(conn)
	dialer.EarlyData = false
	c, err := dialer.DialService(ctx, *cluster, *namespace, *service, int32(*port))
	if err != nil {
		fmt.Printf("dial-error: %s: %s\n", status.Code(err), status.Convert(err).Message())
		conn.Close()
		os.Exit(3)
	}
	c.Close()
	fmt.Println("dial: OK")
}

// fetch asks the Workload API for our SVIDs and bundles, once or, with
// wait, until it answers or wait has passed.
func fetch(wait time.Duration, opts []workloadapi.ClientOption) (*workloadapi.X509Context, error) {
	deadline := time.Now().Add(wait)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		x509ctx, err := workloadapi.FetchX509Context(ctx, opts...)
		cancel()
		if err == nil {
			if len(x509ctx.SVIDs) == 0 {
				return nil, errors.New("the Workload API answered with no SVID")
			}
			return x509ctx, nil
		}
		if time.Now().After(deadline) {
			return nil, err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// static is an SVID and bundles that do not change: this program lives
// seconds.
type static struct {
	svid    *x509svid.SVID
	bundles *x509bundle.Set
}

func (s static) GetX509SVID() (*x509svid.SVID, error) { return s.svid, nil }

func (s static) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	return s.bundles.GetX509BundleForTrustDomain(td)
}

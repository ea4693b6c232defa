//go:build kcptunnel

// This file is not built in this folder: build.sh copies it into kcp's
// cmd/kcp (package main), next to the hook that docs/kcp/webhook-tunnel.patch
// adds there, so that the kcp it builds calls webhook Services through the
// tunnel broker. It is the reference for what a build of kcp with kcpplugin
// adds on top of that patch: one connection to the broker, one dialer, and a
// wrapper per logical cluster that owns webhook configurations.
//
// It is configured from the environment, so that kcp's flags stay kcp's:
//
//	KCP_TUNNEL_BROKER            the broker's gRPC target (host:port, or dns:///name:port for every replica);
//	                             unset: no tunnel, kcp calls webhooks as it always does
//	KCP_TUNNEL_SVID_CERT         kcp's X.509 SVID (leaf first) ...
//	KCP_TUNNEL_SVID_KEY          ... its PKCS#8 key ...
//	KCP_TUNNEL_TRUST_BUNDLE      ... and the trust domain's bundle
//	KCP_TUNNEL_BROKER_SPIFFE_ID  the SPIFFE ID the broker must present (default: any ID in kcp's trust domain)
//
// The files are read once, at start: a long-lived kcp would take a
// workloadapi.X509Source instead, which follows rotations.

package main

import (
	"fmt"
	"os"

	"github.com/kcp-dev/logicalcluster/v3"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffegrpc/grpccredentials"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"k8s.io/apiserver/pkg/util/webhook"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
)

func init() {
	broker := os.Getenv("KCP_TUNNEL_BROKER")
	if broker == "" {
		return
	}
	dialer, err := tunnelDialer(broker)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kcp tunnel:", err)
		os.Exit(1)
	}
	// The patch calls this with the logical cluster that owns the webhook
	// configurations of a request (the APIExport's for bound resources), or
	// the CRD with a conversion webhook: the Services they name are that
	// cluster's.
	webhookAuthenticationInfoResolverWrapper = func(cluster logicalcluster.Name) webhook.AuthenticationInfoResolverWrapper {
		return kcpplugin.AuthInfoResolverWrapper(cluster.String(), dialer)
	}
}

// tunnelDialer connects to the broker with kcp's SVID: the connection lives
// as long as kcp does.
func tunnelDialer(broker string) (*kcpplugin.Dialer, error) {
	svid, err := x509svid.Load(os.Getenv("KCP_TUNNEL_SVID_CERT"), os.Getenv("KCP_TUNNEL_SVID_KEY"))
	if err != nil {
		return nil, fmt.Errorf("loading kcp's SVID: %w", err)
	}
	bundle, err := x509bundle.Load(svid.ID.TrustDomain(), os.Getenv("KCP_TUNNEL_TRUST_BUNDLE"))
	if err != nil {
		return nil, fmt.Errorf("loading the trust bundle: %w", err)
	}
	authorize := tlsconfig.AuthorizeMemberOf(svid.ID.TrustDomain())
	if id := os.Getenv("KCP_TUNNEL_BROKER_SPIFFE_ID"); id != "" {
		brokerID, err := spiffeid.FromString(id)
		if err != nil {
			return nil, fmt.Errorf("KCP_TUNNEL_BROKER_SPIFFE_ID: %w", err)
		}
		authorize = tlsconfig.AuthorizeID(brokerID)
	}
	conn, err := kcpplugin.NewClient(broker, grpccredentials.MTLSClientCredentials(svid, bundle, authorize))
	if err != nil {
		return nil, fmt.Errorf("connecting to the broker %s: %w", broker, err)
	}
	return kcpplugin.NewDialer(conn), nil
}

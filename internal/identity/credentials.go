package identity

import (
	"context"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffegrpc/grpccredentials"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/credentials"
)

// SVIDSource is what a workload presents and trusts: its SVID and the bundles
// it verifies peers with.
type SVIDSource interface {
	x509svid.Source
	x509bundle.Source
}

// ServerCredentials is mTLS that accepts any peer the authorizer accepts.
// Which peer may do what is decided per RPC from PeerID.
func ServerCredentials(src SVIDSource, authorize tlsconfig.Authorizer) credentials.TransportCredentials {
	return grpccredentials.MTLSServerCredentials(src, src, authorize)
}

// ClientCredentials is mTLS to a server whose SPIFFE ID the authorizer accepts.
func ClientCredentials(src SVIDSource, authorize tlsconfig.Authorizer) credentials.TransportCredentials {
	return grpccredentials.MTLSClientCredentials(src, src, authorize)
}

// PeerID is the SPIFFE ID of the peer of an RPC.
func PeerID(ctx context.Context) (spiffeid.ID, bool) {
	return grpccredentials.PeerIDFromContext(ctx)
}

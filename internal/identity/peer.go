package identity

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// AuthInfo is what a handshake through these credentials established about
// the peer. gRPC hands it to every RPC of the connection (peer.FromContext).
//
// Its ID is the one verified during the handshake, never parsed again from
// the certificate afterwards; go-spiffe's and gRPC's own AuthInfo carry a
// *url.URL that gRPC leaves nil for IDs it considers invalid, and calling a
// method on it panicked the process.
type AuthInfo struct {
	credentials.TLSInfo
	// ID is the peer's SPIFFE ID, verified against its trust domain's bundle
	// and known to name a workload (see ValidateWorkloadID).
	ID spiffeid.ID
	// Expires is when the peer's identity stops holding: the earliest
	// NotAfter of the certificate chain it presented.
	Expires time.Time

	// expiry, on the server, closes the connection once the peer's SVID
	// has expired (see CloseExpiredPeers).
	expiry *expiryCloser
}

// newAuthInfo reads the verified peer of a finished handshake.
func newAuthInfo(info credentials.AuthInfo) (AuthInfo, error) {
	tlsInfo, ok := info.(credentials.TLSInfo)
	if !ok {
		return AuthInfo{}, fmt.Errorf("handshake returned %T, not TLS", info)
	}
	certs := tlsInfo.State.PeerCertificates
	if len(certs) == 0 {
		// VerifyConnection refuses this; never reached.
		return AuthInfo{}, refused(ReasonNoCertificate, errNoCertificate)
	}
	id, err := x509svid.IDFromCert(certs[0])
	if err != nil {
		return AuthInfo{}, refused(ReasonInvalidID, err)
	}
	// gRPC's TLSInfo gets the SPIFFE ID verified here, for whatever in
	// gRPC reads it, rather than gRPC's own parse of the certificate.
	tlsInfo.SPIFFEID = id.URL()
	return AuthInfo{TLSInfo: tlsInfo, ID: id, Expires: chainExpiry(tlsInfo.State)}, nil
}

// withAuthInfo makes the AuthInfo of creds' handshakes this package's,
// read from the TLSInfo creds return.
func withAuthInfo(creds credentials.TransportCredentials) credentials.TransportCredentials {
	return &authInfoCreds{TransportCredentials: creds}
}

type authInfoCreds struct {
	credentials.TransportCredentials
}

func (c *authInfoCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return asAuthInfo(c.TransportCredentials.ServerHandshake(raw))
}

func (c *authInfoCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return asAuthInfo(c.TransportCredentials.ClientHandshake(ctx, authority, raw))
}

func asAuthInfo(conn net.Conn, info credentials.AuthInfo, err error) (net.Conn, credentials.AuthInfo, error) {
	if err != nil {
		return nil, nil, err
	}
	ai, err := newAuthInfo(info)
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	return conn, ai, nil
}

func (c *authInfoCreds) Clone() credentials.TransportCredentials {
	return &authInfoCreds{TransportCredentials: c.TransportCredentials.Clone()}
}

// chainExpiry is the earliest NotAfter of the certificates the peer presented.
func chainExpiry(cs tls.ConnectionState) time.Time {
	var first time.Time
	for _, c := range cs.PeerCertificates {
		if first.IsZero() || c.NotAfter.Before(first) {
			first = c.NotAfter
		}
	}
	return first
}

// Peer is what the handshake of ctx's connection established about its peer.
// ok is false for a connection not secured by these credentials.
//
// It is never inlined: AuthInfo holds the whole TLS connection state, about
// 700 bytes, and inlined, its copy would take that room in the caller's
// stack frame. A tunnel's handler calls it, and its frame stays on the
// stack for the tunnel's life (docs/perf-history.md, idle tunnels' stacks).
//
//go:noinline
func Peer(ctx context.Context) (AuthInfo, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return AuthInfo{}, false
	}
	info, ok := p.AuthInfo.(AuthInfo)
	return info, ok && !info.ID.IsZero()
}

// PeerID is the SPIFFE ID of the peer of an RPC. Like Peer, it is never
// inlined, so that the AuthInfo it reads stays out of its caller's frame.
//
//go:noinline
func PeerID(ctx context.Context) (spiffeid.ID, bool) {
	info, ok := Peer(ctx)
	return info.ID, ok
}

// Package webhook stands for kcp in the release check: a module of its own,
// outside the tunnel's repository, that requires kcpplugin at a released
// version and wires it into k8s.io/apiserver's webhook admission plugin as
// kcp does, per logical cluster.
package webhook

import (
	"crypto/tls"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	webhookutil "k8s.io/apiserver/pkg/util/webhook"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
)

// Tunnel is kcp's one connection to the broker replicas.
type Tunnel struct {
	conn   *grpc.ClientConn
	dialer *kcpplugin.Dialer
}

// Connect connects to the broker at broker (host:port) with tlsConfig
// (kcp's SPIFFE identity; in kcp, go-spiffe's grpccredentials and
// tlsconfig give the same credentials). Each tunnel is a Dial stream on
// that one connection, its first write sent with the dial (early data).
func Connect(broker string, tlsConfig *tls.Config) (*Tunnel, error) {
	conn, err := kcpplugin.NewClient(broker, credentials.NewTLS(tlsConfig))
	if err != nil {
		return nil, err
	}
	return &Tunnel{conn: conn, dialer: kcpplugin.NewDialer(conn)}, nil
}

// WrapperFor is what kcp applies, last, to the webhook plugins (admission
// and CRD conversion alike) of the logical cluster that owns the webhook
// configuration or the CRD.
func (t *Tunnel) WrapperFor(cluster string) webhookutil.AuthenticationInfoResolverWrapper {
	return kcpplugin.AuthInfoResolverWrapper(cluster, t.dialer)
}

// Close closes the connection, which ends every tunnel on it.
func (t *Tunnel) Close() error {
	return t.conn.Close()
}

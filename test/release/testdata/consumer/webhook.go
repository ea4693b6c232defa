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
// tlsconfig give the same credentials), its tunnels on dial connections.
func Connect(broker string, tlsConfig *tls.Config) (*Tunnel, error) {
	conn, err := kcpplugin.NewClient(broker, credentials.NewTLS(tlsConfig))
	if err != nil {
		return nil, err
	}
	dialer := kcpplugin.NewDialer(conn, kcpplugin.WithDialConnections(kcpplugin.DialConnections{Address: broker, TLS: tlsConfig}))
	return &Tunnel{conn: conn, dialer: dialer}, nil
}

// WrapperFor is what kcp applies, last, to the webhook plugins (admission
// and CRD conversion alike) of the logical cluster that owns the webhook
// configuration or the CRD.
func (t *Tunnel) WrapperFor(cluster string) webhookutil.AuthenticationInfoResolverWrapper {
	return kcpplugin.AuthInfoResolverWrapper(cluster, t.dialer)
}

// Close closes the dialer's spare dial connections and the connection.
func (t *Tunnel) Close() error {
	_ = t.dialer.Close()
	return t.conn.Close()
}

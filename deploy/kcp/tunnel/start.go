package tunnel

import (
	"context"
	"fmt"
	"io"

	"github.com/go-logr/logr"
	"github.com/kcp-dev/logicalcluster/v3"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffegrpc/grpccredentials"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
	"k8s.io/apiserver/pkg/util/webhook"

	"github.com/kcp-dev/tunnel-broker/kcpplugin"
)

// WrapperFunc is kcp's seam: the webhook client's wrapper for the webhooks
// and conversion webhooks a logical cluster owns.
type WrapperFunc = func(cluster logicalcluster.Name) webhook.AuthenticationInfoResolverWrapper

// source is kcp's SVID and its trust domain's bundle, and what stops them.
type source interface {
	x509svid.Source
	x509bundle.Source
	io.Closer
}

// Start gets kcp's SVID and makes the broker's connection (it does not wait
// for a broker: a dial does, within --tunnel-dial-timeout). It returns the
// wrapper for kcp's seam, nil without --tunnel-broker, and what closes the
// connection and the SVID source.
func (o *Options) Start(ctx context.Context, log logr.Logger) (WrapperFunc, func(), error) {
	if o.Broker == "" {
		return nil, func() {}, nil
	}
	src, err := o.source(ctx, log)
	if err != nil {
		return nil, nil, err
	}
	svid, err := src.GetX509SVID()
	if err != nil {
		src.Close()
		return nil, nil, err
	}
	authorize := tlsconfig.AuthorizeMemberOf(svid.ID.TrustDomain())
	if o.BrokerID != "" {
		authorize = tlsconfig.AuthorizeID(spiffeid.RequireFromString(o.BrokerID))
	}
	conn, err := kcpplugin.NewClient(o.Broker, grpccredentials.MTLSClientCredentials(src, src, authorize))
	if err != nil {
		src.Close()
		return nil, nil, fmt.Errorf("--tunnel-broker %s: %w", o.Broker, err)
	}
	dialer := kcpplugin.NewDialer(conn)
	dialer.Timeout = o.DialTimeout
	log.Info("calling webhook Services through the tunnel broker", "broker", o.Broker, "id", svid.ID.String(), "brokerID", o.BrokerID)

	wrapper := func(cluster logicalcluster.Name) webhook.AuthenticationInfoResolverWrapper {
		return kcpplugin.AuthInfoResolverWrapper(cluster.String(), dialer)
	}
	return wrapper, func() { conn.Close(); src.Close() }, nil
}

// source returns kcp's SVID source: the SVID files, followed as they
// rotate, or the Workload API, whose SVIDs rotate by themselves.
func (o *Options) source(ctx context.Context, log logr.Logger) (source, error) {
	if o.SVIDCert != "" {
		s, err := loadFiles(o.SVIDCert, o.SVIDKey, o.TrustBundle, log)
		if err != nil {
			return nil, err
		}
		s.watch(o.FileReload)
		return s, nil
	}
	socket := o.socket()
	wait, cancel := context.WithTimeout(ctx, o.WorkloadAPITimeout)
	defer cancel()
	s, err := workloadapi.NewX509Source(wait, workloadapi.WithClientOptions(workloadapi.WithAddr(socket)))
	if err != nil {
		return nil, fmt.Errorf("no X.509-SVID for kcp from the Workload API at %s within %v (is kcp's pod registered with SPIRE?): %w",
			socket, o.WorkloadAPITimeout, err)
	}
	return s, nil
}

package kcpplugin

import (
	"context"
	"net"
	"net/http"
	"net/url"

	webhookutil "k8s.io/apiserver/pkg/util/webhook"
	"k8s.io/client-go/rest"
)

// AuthInfoResolverWrapper makes webhook calls for Services of the given cluster go through d.
// It sets rest.Config.Dial for service references only (URL webhooks are untouched) and
// disables HTTP proxies for them, so TLS (caBundle, ServerName name.ns.svc) runs end to end.
//
// kcp caches webhook clients per webhook configuration, so cluster must be the
// logical cluster that owns the configuration, bound here once, never taken
// from a request's context. Apply it last: the last wrapper is outermost.
func AuthInfoResolverWrapper(cluster string, d ServiceDialer) webhookutil.AuthenticationInfoResolverWrapper {
	return func(delegate webhookutil.AuthenticationInfoResolver) webhookutil.AuthenticationInfoResolver {
		return &webhookutil.AuthenticationInfoResolverDelegator{
			ClientConfigForFunc: delegate.ClientConfigFor,
			ClientConfigForServiceFunc: func(serviceName, serviceNamespace string, servicePort int) (*rest.Config, error) {
				cfg, err := delegate.ClientConfigForService(serviceName, serviceNamespace, servicePort)
				if err != nil {
					return nil, err
				}
				cfg = rest.CopyConfig(cfg)
				// The address the transport asks for is name.ns.svc:port (or
				// whatever a round tripper rewrote it to); the tunnel dials
				// by Service, so it is not used.
				cfg.Dial = func(ctx context.Context, _, _ string) (net.Conn, error) {
					return d.DialService(ctx, cluster, serviceNamespace, serviceName, int32(servicePort))
				}
				// A nil Proxy means the environment's proxy, which would send
				// CONNECT down the tunnel instead of TLS.
				cfg.Proxy = func(*http.Request) (*url.URL, error) { return nil, nil }
				return cfg, nil
			},
		}
	}
}

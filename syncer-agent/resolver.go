package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kcp-dev/tunnel-broker/syncer-agent/lookup"
)

// resolverFlags choose where the agent finds Services: a static file, or the
// physical cluster's API (syncer or plain mode).
type resolverFlags struct {
	services      string
	kubeconfig    string
	syncTarget    lookup.SyncTarget
	plainCluster  string
	trustSlicesIn string
}

func addResolverFlags(fs *flag.FlagSet) *resolverFlags {
	f := &resolverFlags{}
	fs.StringVar(&f.services, "services", "", "static mapping file of Services to addresses (YAML), instead of the physical cluster's API")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig of the physical cluster (default: in-cluster config)")
	fs.StringVar(&f.syncTarget.Name, "sync-target-name", "", "syncer mode: serve the namespaces kcp's syncer made for this sync target")
	fs.StringVar(&f.syncTarget.Cluster, "sync-target-cluster", "", "syncer mode: logical cluster (or, for old syncers, workspace path) of the sync target")
	fs.StringVar(&f.syncTarget.UID, "sync-target-uid", "", "syncer mode: UID of the sync target")
	fs.StringVar(&f.plainCluster, "plain-cluster", "", "plain mode: serve this logical cluster, whose namespaces have the same names in the physical cluster")
	fs.StringVar(&f.trustSlicesIn, "trust-endpointslices-in", "", "where the agent dials EndpointSlices as written, e.g. of Services without a selector: CLUSTER or CLUSTER/NAMESPACE, comma-separated, \"*\" for all (default none: it dials only addresses of Pods a Service selects)")
	return f
}

// resolver is the agent's Resolver and what it needs before it may register.
type resolver struct {
	lookup.Resolver
	// forAgent is the Resolver to give one agent (one per broker replica):
	// each needs a ClustersChanged channel of its own.
	forAgent func() lookup.Resolver
	// ready blocks until the resolver can answer (caches synced).
	ready func(ctx context.Context) error
	// stop waits for the resolver's background work after ctx ended.
	stop func()
}

// check refuses flags that choose no resolver, or two.
func (f *resolverFlags) check() error {
	kube := f.syncTarget != (lookup.SyncTarget{}) || f.plainCluster != "" || f.kubeconfig != "" || f.trustSlicesIn != ""
	switch {
	case f.services != "" && kube:
		return errors.New("--services excludes --kubeconfig, --sync-target-*, --plain-cluster and --trust-endpointslices-in")
	case f.services == "" && f.syncTarget.Name == "" && f.plainCluster == "":
		return errors.New("give --services FILE, or --sync-target-name (with --sync-target-cluster and/or --sync-target-uid), or --plain-cluster")
	}
	return nil
}

// newResolver builds the resolver the flags choose and starts it under ctx.
func (f *resolverFlags) newResolver(ctx context.Context, log *slog.Logger) (*resolver, error) {
	if err := f.check(); err != nil {
		return nil, err
	}
	switch {
	case f.services != "":
		s, err := lookup.LoadStatic(f.services)
		if err != nil {
			return nil, fmt.Errorf("--services: %w", err)
		}
		return &resolver{Resolver: s, forAgent: func() lookup.Resolver { return s },
			ready: func(context.Context) error { return nil }, stop: func() {}}, nil
	}

	trust, err := lookup.ParseScope(f.trustSlicesIn)
	if err != nil {
		return nil, fmt.Errorf("--trust-endpointslices-in: %w", err)
	}
	if trust.String() != "" {
		log.Info("taking EndpointSlices as written, without checking that they name Pods the Service selects", "in", trust.String())
	}
	config, err := f.restConfig()
	if err != nil {
		return nil, err
	}
	config.UserAgent = "kcp-tunnel-syncer-agent"
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return nil, err
	}
	k, err := lookup.NewKube(client, lookup.KubeOptions{
		SyncTarget:            f.syncTarget,
		PlainCluster:          f.plainCluster,
		TrustEndpointSlicesIn: trust,
		APIServerAddrs:        apiServerAddrs(ctx, config.Host, log),
		Log:                   log,
	})
	if err != nil {
		return nil, err
	}
	k.Start(ctx)
	return &resolver{Resolver: k, forAgent: k.Subscribe, ready: k.WaitForCacheSync, stop: k.Shutdown}, nil
}

func (f *resolverFlags) restConfig() (*rest.Config, error) {
	if f.kubeconfig == "" {
		c, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("no --kubeconfig and not in a cluster: %w", err)
		}
		return c, nil
	}
	return clientcmd.BuildConfigFromFlags("", f.kubeconfig)
}

// apiServerAddrs are the addresses of the API server host, refused as dial
// targets. A name that does not resolve now is only logged: the
// default/kubernetes Service still names the API server's addresses.
func apiServerAddrs(ctx context.Context, host string, log *slog.Logger) []netip.Addr {
	u, err := url.Parse(host)
	if err != nil || u.Host == "" {
		u = &url.URL{Host: host}
	}
	name := u.Hostname()
	if ip, err := netip.ParseAddr(name); err == nil {
		return []netip.Addr{ip}
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", name)
	if err != nil {
		log.Warn("could not resolve the API server's name; relying on the default/kubernetes Service to refuse its addresses", "host", name, "error", err)
	}
	return ips
}

package lookup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"slices"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// KubeOptions configure a Kube resolver. Exactly one of SyncTarget.Name and
// PlainCluster is set.
type KubeOptions struct {
	// SyncTarget selects syncer mode: the agent serves the namespaces that
	// kcp's syncer made for this sync target, found by their locator
	// annotations, for every logical cluster they come from.
	SyncTarget SyncTarget
	// PlainCluster selects plain mode: the agent serves this one logical
	// cluster, whose namespaces have the same names here.
	PlainCluster string
	// TrustEndpointSlicesIn are the namespaces whose EndpointSlices the
	// agent takes as written, e.g. those of Services without a selector.
	// Elsewhere it dials only what the control plane vouches for: addresses
	// of Pods the Service selects, from slices Kubernetes' EndpointSlice
	// controller owns (vouch.go), so that nobody who may write an
	// EndpointSlice can aim the agent at an address of their choosing.
	TrustEndpointSlicesIn Scope
	// APIServerAddrs are the API server's addresses as the agent reaches
	// it. They are refused as targets, as are the addresses of the
	// default/kubernetes Service.
	APIServerAddrs []netip.Addr
	Log            *slog.Logger
}

// Kube resolves Services of the physical cluster from shared informers on
// namespaces, Services, EndpointSlices and Pods: a dial makes no API call,
// and the agent keeps serving from its caches while the API server is away
// (the informers reconnect with backoff by themselves).
type Kube struct {
	factory    informers.SharedInformerFactory
	namespaces cache.SharedIndexInformer
	services   cache.SharedIndexInformer
	slices     cache.SharedIndexInformer
	pods       cache.SharedIndexInformer
	mapper     namespaceMapper
	picker     *endpointPicker
	trust      Scope
	apiServer  []netip.Addr
	log        *slog.Logger

	changed      chan struct{}
	mu           sync.Mutex
	subscribers  []chan struct{} // see Subscribe
	watching     bool            // set once the caches synced: changes count from then
	lastClusters []string
}

// NewKube sets up the informers; Start runs them.
func NewKube(client kubernetes.Interface, opts KubeOptions) (*Kube, error) {
	if err := opts.validate(); err != nil {
		return nil, err
	}
	if opts.Log == nil {
		opts.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTransform(slim))
	k := &Kube{
		factory:    factory,
		namespaces: factory.Core().V1().Namespaces().Informer(),
		services:   factory.Core().V1().Services().Informer(),
		slices:     factory.Discovery().V1().EndpointSlices().Informer(),
		pods:       factory.Core().V1().Pods().Informer(),
		trust:      opts.TrustEndpointSlicesIn,
		apiServer:  opts.APIServerAddrs,
		log:        opts.Log,
		changed:    make(chan struct{}, 1),
	}
	if err := k.slices.AddIndexers(endpointSliceIndexers()); err != nil {
		return nil, err
	}
	if err := k.slices.AddIndexers(endpointAddressIndexers()); err != nil {
		return nil, err
	}
	if err := k.services.AddIndexers(serviceIndexers()); err != nil {
		return nil, err
	}
	k.picker = &endpointPicker{slices: k.slices.GetIndexer(), pods: k.pods.GetIndexer()}
	if err := k.mapNamespaces(opts); err != nil {
		return nil, err
	}
	if err := k.logWatchErrors(); err != nil {
		return nil, err
	}
	return k, nil
}

// validate checks that the options choose one mode, and name what it
// needs.
func (opts KubeOptions) validate() error {
	syncer, plain := opts.SyncTarget.Name != "", opts.PlainCluster != ""
	switch {
	case syncer == plain:
		return errors.New("give either a sync target name (syncer mode) or a plain cluster (plain mode)")
	case syncer && opts.SyncTarget.Cluster == "" && opts.SyncTarget.UID == "":
		return errors.New("a sync target name is unique only within its workspace: give its cluster or its UID as well")
	case plain:
		return tunnelv1.ValidateClusterName(opts.PlainCluster)
	}
	return nil
}

// mapNamespaces sets up the namespace mapper of the mode the options
// choose. In syncer mode the clusters served come and go with the syncer's
// namespaces, so it watches them.
func (k *Kube) mapNamespaces(opts KubeOptions) error {
	if opts.PlainCluster != "" {
		k.mapper = &plainNamespaces{indexer: k.namespaces.GetIndexer(), cluster: opts.PlainCluster}
		return nil
	}
	if err := k.namespaces.AddIndexers(namespaceIndexers(opts.SyncTarget)); err != nil {
		return err
	}
	k.mapper = &syncerNamespaces{indexer: k.namespaces.GetIndexer(), syncTarget: opts.SyncTarget}
	notify := func(any) { k.noteClusters() }
	_, err := k.namespaces.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    notify,
		UpdateFunc: func(_, obj any) { notify(obj) },
		DeleteFunc: notify,
	})
	return err
}

// logWatchErrors logs, per resource, why a watch of the physical cluster
// failed; the informers retry by themselves.
func (k *Kube) logWatchErrors() error {
	for resource, inf := range map[string]cache.SharedIndexInformer{
		"namespaces": k.namespaces, "services": k.services, "endpointslices": k.slices, "pods": k.pods,
	} {
		if err := inf.SetWatchErrorHandler(func(_ *cache.Reflector, err error) {
			if !errors.Is(err, io.EOF) { // a watch the server closed is routine
				k.log.Warn("watching the physical cluster failed; serving from cache and retrying", "resource", resource, "error", err)
			}
		}); err != nil {
			return err
		}
	}
	return nil
}

// slim keeps the caches small: it drops the managed fields, which the agent
// never reads, and all of a Pod but what the agent checks. It leaves what
// it already slimmed as it is.
func slim(obj any) (any, error) {
	switch o := obj.(type) {
	case *corev1.Namespace:
		o.ManagedFields = nil
	case *corev1.Service:
		o.ManagedFields = nil
	case *discoveryv1.EndpointSlice:
		o.ManagedFields = nil
	case *corev1.Pod:
		return slimPod(o), nil
	}
	return obj, nil
}

// Start runs the informers until ctx ends; Shutdown waits for them.
func (k *Kube) Start(ctx context.Context) { k.factory.Start(ctx.Done()) }

// Shutdown waits for the informers to stop after Start's ctx ended.
func (k *Kube) Shutdown() { k.factory.Shutdown() }

// WaitForCacheSync returns once every cache holds the cluster's state, or an
// error when ctx ends first. The agent must not register before: it would
// announce too few clusters and refuse dials it could serve.
func (k *Kube) WaitForCacheSync(ctx context.Context) error {
	for typ, ok := range k.factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("cache of %v did not sync: %w", typ, context.Cause(ctx))
		}
	}
	// The clusters now are the ones the agent registers first: a change
	// is whatever differs from them.
	k.mu.Lock()
	k.watching, k.lastClusters = true, k.mapper.clusters()
	k.mu.Unlock()
	return nil
}

func (k *Kube) synced() bool {
	return k.namespaces.HasSynced() && k.services.HasSynced() && k.slices.HasSynced() && k.pods.HasSynced()
}

// Clusters implements Resolver.
func (k *Kube) Clusters() []string { return k.mapper.clusters() }

// ClustersChanged implements ClusterWatcher, for one listener; more call
// Subscribe.
func (k *Kube) ClustersChanged() <-chan struct{} { return k.changed }

// Subscribe returns k with a ClustersChanged channel of its own. A signal on
// a channel reaches one reader only, so each agent (one per broker replica)
// needs its own view.
func (k *Kube) Subscribe() Resolver {
	k.mu.Lock()
	defer k.mu.Unlock()
	ch := make(chan struct{}, 1)
	k.subscribers = append(k.subscribers, ch)
	return &kubeSubscriber{Kube: k, changed: ch}
}

type kubeSubscriber struct {
	*Kube
	changed chan struct{}
}

func (s *kubeSubscriber) ClustersChanged() <-chan struct{} { return s.changed }

// noteClusters fires ClustersChanged if the set of clusters is not the one
// last seen. Namespace events call it after the cache has the change.
func (k *Kube) noteClusters() {
	k.mu.Lock()
	defer k.mu.Unlock()
	now := k.mapper.clusters()
	if !k.watching || slices.Equal(now, k.lastClusters) {
		return
	}
	k.lastClusters = now
	k.log.Info("logical clusters changed", "clusters", now)
	for _, ch := range append([]chan struct{}{k.changed}, k.subscribers...) {
		select {
		case ch <- struct{}{}:
		default: // one pending signal is enough: the listener reads Clusters anew
		}
	}
}

// Resolve implements Resolver: the ready endpoints of the target's Service
// port in the namespace mapped to the target's namespace, best first. A
// target that names an address is resolved as the Service it belongs to
// (byaddress.go).
func (k *Kube) Resolve(ctx context.Context, t *tunnelv1.Target) ([]string, error) {
	if err := t.Validate(); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if !k.synced() {
		return nil, status.Error(codes.Unavailable, "the agent has not yet read the physical cluster's Services")
	}
	if t.GetIp() != "" {
		return k.resolveAddress(ctx, t)
	}
	what := fmt.Sprintf("service %s/%s port %d of logical cluster %s", t.GetNamespace(), t.GetService(), t.GetPort(), t.GetCluster())
	ns, err := k.mapper.downstream(t)
	if err != nil {
		return nil, err
	}
	svc, err := k.service(ns, t.GetService())
	if err != nil {
		if apierrors.IsNotFound(err) {
			return nil, status.Errorf(codes.NotFound, "%s: no such Service", what)
		}
		return nil, status.Errorf(codes.Internal, "%s: %v", what, err)
	}
	if svc.Spec.Type == corev1.ServiceTypeExternalName {
		return nil, status.Errorf(codes.PermissionDenied, "%s: ExternalName Services are refused: the agent connects only to endpoints of the physical cluster", what)
	}
	sp, err := servicePort(svc, t.GetPort(), what)
	if err != nil {
		return nil, err
	}
	trusted := k.trust.Contains(t.GetCluster(), t.GetNamespace())
	return k.picker.addresses(svc, sp, k.apiServerAddrs(), trusted, what)
}

func (k *Kube) service(namespace, name string) (*corev1.Service, error) {
	obj, exists, err := k.services.GetIndexer().GetByKey(namespace + "/" + name)
	if err != nil {
		return nil, err
	}
	if !exists {
		return nil, apierrors.NewNotFound(corev1.Resource("services"), name)
	}
	return obj.(*corev1.Service), nil
}

// apiServerAddrs are the configured API server addresses and those of the
// default/kubernetes Service, its cluster IPs and endpoints, as cached now.
func (k *Kube) apiServerAddrs() map[netip.Addr]bool {
	addrs := map[netip.Addr]bool{}
	for _, a := range k.apiServer {
		addrs[a.Unmap()] = true
	}
	if svc, err := k.service(metav1.NamespaceDefault, "kubernetes"); err == nil {
		for _, ip := range append([]string{svc.Spec.ClusterIP}, svc.Spec.ClusterIPs...) {
			if a, err := netip.ParseAddr(ip); err == nil {
				addrs[a.Unmap()] = true
			}
		}
	}
	objs, _ := k.slices.GetIndexer().ByIndex(byService, metav1.NamespaceDefault+"/kubernetes")
	for _, obj := range objs {
		for _, ep := range obj.(*discoveryv1.EndpointSlice).Endpoints {
			for _, ip := range ep.Addresses {
				if a, err := netip.ParseAddr(ip); err == nil {
					addrs[a.Unmap()] = true
				}
			}
		}
	}
	return addrs
}

package lookup

import (
	"context"
	"fmt"
	"net/netip"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/client-go/tools/cache"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// A target may name an address instead of a Service (Target.ip): what
// kube-apiserver's egress selector dials is a Service's ClusterIP and port
// (its default service resolver), or a ready endpoint's IP and target port
// (with --enable-aggregator-routing). The agent maps the address back to
// the Service it belongs to and then resolves that Service as any other
// target, so an address gets through exactly the checks a Service does:
// the same namespaces, the same vouched-for endpoints, the same refused
// addresses. An address that belongs to no Service of the target's cluster
// is refused; the agent never dials an address because a caller named it.

// Informer indexes for targets that name an address.
const (
	byClusterIP = "clusterIP" // a Service's cluster IPs, in netip's spelling
	byAddress   = "address"   // the addresses of an EndpointSlice's endpoints, likewise
)

func serviceIndexers() cache.Indexers {
	return cache.Indexers{byClusterIP: func(obj any) ([]string, error) {
		svc, ok := obj.(*corev1.Service)
		if !ok {
			return nil, nil
		}
		return canonicalIPs(append([]string{svc.Spec.ClusterIP}, svc.Spec.ClusterIPs...)), nil
	}}
}

func endpointAddressIndexers() cache.Indexers {
	return cache.Indexers{byAddress: func(obj any) ([]string, error) {
		slice, ok := obj.(*discoveryv1.EndpointSlice)
		if !ok {
			return nil, nil
		}
		var ips []string
		for _, ep := range slice.Endpoints {
			ips = append(ips, ep.Addresses...)
		}
		return canonicalIPs(ips), nil
	}}
}

// canonicalIPs are the IP addresses among ips (not "None", not ""), each
// once, spelt as netip spells them, as Target.ip must be.
func canonicalIPs(ips []string) []string {
	var out []string
	for _, s := range ips {
		if ip, err := netip.ParseAddr(s); err == nil && !slices.Contains(out, ip.Unmap().String()) {
			out = append(out, ip.Unmap().String())
		}
	}
	return out
}

// resolveAddress resolves a target that names an address: as the Service
// whose cluster IP it is, or as the one endpoint of a Service it is.
func (k *Kube) resolveAddress(ctx context.Context, t *tunnelv1.Target) ([]string, error) {
	ip := netip.MustParseAddr(t.GetIp()).Unmap() // Validate checked it
	what := fmt.Sprintf("address %s port %d in logical cluster %s", ip, t.GetPort(), t.GetCluster())
	if why := refusedAddress(ip, k.apiServerAddrs()); why != "" {
		return nil, status.Errorf(codes.PermissionDenied, "%s: refused: it is %s", what, why)
	}
	if svc, ok := k.serviceWithClusterIP(t.GetCluster(), ip); ok {
		svc.Port = t.GetPort() // a cluster IP's port is the Service's
		return k.Resolve(ctx, &svc)
	}
	addrs, found, err := k.resolveEndpoint(ctx, t, ip, what)
	if found {
		return addrs, err
	}
	return nil, status.Errorf(codes.PermissionDenied,
		"%s: refused: it is neither the cluster IP of a Service nor a ready endpoint of one in that logical cluster, and the agent dials only Services", what)
}

// serviceWithClusterIP is the target of the Service of cluster whose
// cluster IP ip is, without its port.
func (k *Kube) serviceWithClusterIP(cluster string, ip netip.Addr) (tunnelv1.Target, bool) {
	objs, _ := k.services.GetIndexer().ByIndex(byClusterIP, ip.String())
	for _, obj := range objs {
		svc := obj.(*corev1.Service)
		if c, ns, ok := k.mapper.upstream(svc.Namespace); ok && c == cluster {
			return tunnelv1.Target{Cluster: c, Namespace: ns, Service: svc.Name}, true
		}
	}
	return tunnelv1.Target{}, false
}

// resolveEndpoint resolves t as the endpoint ip of a Service of t's cluster
// whose target port is t's port: the Service is resolved as any target,
// and ip:port must be among the addresses that gives. found is false if
// ip is no endpoint of such a Service, ready or not.
func (k *Kube) resolveEndpoint(ctx context.Context, t *tunnelv1.Target, ip netip.Addr, what string) (addrs []string, found bool, err error) {
	objs, _ := k.slices.GetIndexer().ByIndex(byAddress, ip.String())
	want := netip.AddrPortFrom(ip, uint16(t.GetPort())).String()
	for _, obj := range objs {
		svcTarget, ok := k.serviceOfSlice(obj.(*discoveryv1.EndpointSlice), t)
		if !ok {
			continue
		}
		found = true
		addrs, err = k.Resolve(ctx, &svcTarget)
		if err == nil && slices.Contains(addrs, want) {
			return []string{want}, true, nil
		}
	}
	if !found {
		return nil, false, nil
	}
	if err != nil {
		return nil, true, err
	}
	return nil, true, status.Errorf(codes.PermissionDenied,
		"%s: refused: it is not a ready endpoint that the agent vouches for of the Service it belongs to", what)
}

// serviceOfSlice is the target, Service port included, of the Service of
// t's cluster that slice belongs to, if one of its TCP ports has t's port
// as its target port in slice.
func (k *Kube) serviceOfSlice(slice *discoveryv1.EndpointSlice, t *tunnelv1.Target) (tunnelv1.Target, bool) {
	name, ok := slice.Labels[discoveryv1.LabelServiceName]
	if !ok {
		return tunnelv1.Target{}, false
	}
	cluster, ns, ok := k.mapper.upstream(slice.Namespace)
	if !ok || cluster != t.GetCluster() {
		return tunnelv1.Target{}, false
	}
	svc, err := k.service(slice.Namespace, name)
	if err != nil {
		return tunnelv1.Target{}, false
	}
	for _, sp := range svc.Spec.Ports {
		if sp.Protocol != "" && sp.Protocol != corev1.ProtocolTCP {
			continue
		}
		if port, ok := slicePort(slice, sp.Name); ok && uint32(port) == t.GetPort() {
			return tunnelv1.Target{Cluster: cluster, Namespace: ns, Service: svc.Name, Port: uint32(sp.Port)}, true
		}
	}
	return tunnelv1.Target{}, false
}

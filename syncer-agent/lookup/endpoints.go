package lookup

import (
	"net/netip"
	"sort"
	"sync/atomic"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/tools/cache"

	"github.com/kcp-dev/tunnel-broker/internal/errinfo"
)

// EndpointSliceController is the managed-by value of the EndpointSlices that
// Kubernetes' own controller writes from a Service's selector.
const EndpointSliceController = "endpointslice-controller.k8s.io"

// byService indexes EndpointSlices by "<namespace>/<Service name>".
const byService = "service"

func endpointSliceIndexers() cache.Indexers {
	return cache.Indexers{byService: func(obj any) ([]string, error) {
		s, ok := obj.(*discoveryv1.EndpointSlice)
		if !ok {
			return nil, nil
		}
		name, ok := s.Labels[discoveryv1.LabelServiceName]
		if !ok {
			return nil, nil
		}
		return []string{s.Namespace + "/" + name}, nil
	}}
}

// servicePort is the Service's TCP port that a dial names.
func servicePort(svc *corev1.Service, port uint32, what string) (corev1.ServicePort, error) {
	for _, sp := range svc.Spec.Ports {
		if uint32(sp.Port) == port && (sp.Protocol == "" || sp.Protocol == corev1.ProtocolTCP) {
			return sp, nil
		}
	}
	return corev1.ServicePort{}, status.Errorf(codes.NotFound, "%s: the Service has no TCP port %d", what, port)
}

// endpointPicker chooses endpoints from the Services' EndpointSlices.
type endpointPicker struct {
	slices cache.Indexer
	pods   cache.Indexer // of *cachedPod
	// next rotates the first endpoint from dial to dial, to spread load.
	next atomic.Uint64
}

// addresses are the host:port addresses of the ready, serving endpoints of
// the Service port sp, in the order the agent should try them.
//
// The EndpointSlice controller resolves targetPort, a number or a container
// port's name, per pod, and writes the result under the Service port's name;
// so the slice's port with that name is the targetPort, in either form, and
// Services without a selector, whose slices someone else writes, work alike.
//
// Unless trusted (the operator trusts the dial's namespace's EndpointSlices
// as written), an endpoint is taken only if the control plane vouches for
// it (vouch.go): a Service without a selector has none.
func (p *endpointPicker) addresses(svc *corev1.Service, sp corev1.ServicePort, apiServer map[netip.Addr]bool, trusted bool, what string) ([]string, error) {
	if !trusted && len(svc.Spec.Selector) == 0 {
		return nil, status.Errorf(codes.PermissionDenied,
			"%s: the Service has no selector, so nothing vouches for its endpoints: the agent dials only Pods a Service selects (%s)", what, trustHint)
	}
	objs, err := p.slices.ByIndex(byService, svc.Namespace+"/"+svc.Name)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "endpointslice index: %v", err)
	}
	c := &endpointChoice{
		pods: p.pods, svc: svc, selector: labels.Set(svc.Spec.Selector).AsSelectorPreValidated(),
		apiServer: apiServer, trusted: trusted, ready: map[string]bool{},
	}
	for _, obj := range objs {
		c.addSlice(obj.(*discoveryv1.EndpointSlice), sp.Name)
	}
	if len(c.ready) > 0 {
		return p.rotate(c.ready), nil
	}
	return nil, c.none(what)
}

// endpointChoice is one dial's choice among a Service's endpoints: the
// addresses it may connect to, and why it may not connect to the others.
type endpointChoice struct {
	pods      cache.Indexer
	svc       *corev1.Service
	selector  labels.Selector
	apiServer map[netip.Addr]bool
	trusted   bool

	ready   map[string]bool // host:port
	refused refusals
	unready int
}

// addSlice takes the ready endpoints of slice for the Service port named
// portName.
func (c *endpointChoice) addSlice(slice *discoveryv1.EndpointSlice, portName string) {
	if !c.trusted {
		if why := unvouchedSlice(slice, c.svc); why != "" {
			c.refused.add("%s", why)
			return
		}
	}
	port, ok := slicePort(slice, portName)
	if !ok {
		return
	}
	for _, ep := range slice.Endpoints {
		c.addEndpoint(slice, port, ep)
	}
}

// addEndpoint takes the addresses of ep if it is ready and, unless
// trusted, a Pod the Service selects.
func (c *endpointChoice) addEndpoint(slice *discoveryv1.EndpointSlice, port uint16, ep discoveryv1.Endpoint) {
	if !isReady(ep.Conditions) {
		c.unready++
		return
	}
	var pod *cachedPod
	if !c.trusted {
		var why string
		if pod, why = podOf(c.pods, ep.TargetRef, c.svc, c.selector); why != "" {
			c.refused.add("%s of EndpointSlice %s %s", firstAddress(ep), slice.Name, why)
			return
		}
	}
	for _, a := range ep.Addresses {
		c.addAddress(slice, port, pod, a)
	}
}

// addAddress takes the address a of an endpoint of pod (nil if trusted),
// unless it is no IP address, one the agent must not connect to, or not
// the Pod's.
func (c *endpointChoice) addAddress(slice *discoveryv1.EndpointSlice, port uint16, pod *cachedPod, a string) {
	if slice.AddressType != discoveryv1.AddressTypeIPv4 && slice.AddressType != discoveryv1.AddressTypeIPv6 {
		c.refused.add("%s is not an IP address (address type %s)", a, slice.AddressType)
		return
	}
	ip, err := netip.ParseAddr(a)
	if err != nil {
		c.refused.add("%s is not an IP address", a)
		return
	}
	addr := netip.AddrPortFrom(ip.Unmap(), port).String()
	if why := refusedAddress(ip, c.apiServer); why != "" {
		c.refused.add("%s is %s", addr, why)
		return
	}
	if pod != nil && !pod.has(ip) {
		c.refused.add("%s of EndpointSlice %s is not an address of Pod %s", a, slice.Name, pod.Name)
		return
	}
	c.ready[addr] = true
}

// none is the error for a dial that found no endpoint to connect to.
func (c *endpointChoice) none(what string) error {
	switch {
	case !c.refused.empty() && c.trusted:
		return status.Errorf(codes.PermissionDenied, "%s: refusing its endpoints: %s", what, &c.refused)
	case !c.refused.empty():
		return status.Errorf(codes.PermissionDenied, "%s: refusing its endpoints: %s; the agent dials only Pods the Service selects, as Kubernetes' EndpointSlice controller lists them (%s)",
			what, &c.refused, trustHint)
	case c.unready > 0:
		return status.Errorf(codes.Unavailable, "%s: none of its %d endpoints is ready", what, c.unready)
	}
	return errinfo.Errorf(codes.Unavailable, errinfo.NoEndpoints, "%s: the Service has no endpoints", what)
}

// trustHint tells an operator how to let the agent take a namespace's
// EndpointSlices as written.
const trustHint = "see the agent's --trust-endpointslices-in"

// firstAddress names an endpoint in messages.
func firstAddress(ep discoveryv1.Endpoint) string {
	if len(ep.Addresses) == 0 {
		return "an endpoint without addresses"
	}
	return ep.Addresses[0]
}

// slicePort is the port number that slice gives the Service port named name.
func slicePort(slice *discoveryv1.EndpointSlice, name string) (uint16, bool) {
	for _, p := range slice.Ports {
		if p.Port == nil || *p.Port < 1 || *p.Port > 65535 {
			continue
		}
		if p.Protocol != nil && *p.Protocol != corev1.ProtocolTCP {
			continue
		}
		if (p.Name == nil && name == "") || (p.Name != nil && *p.Name == name) {
			return uint16(*p.Port), true
		}
	}
	return 0, false
}

// isReady: ready and serving (nil means true for both, as the API says), and
// not terminating.
func isReady(c discoveryv1.EndpointConditions) bool {
	return (c.Ready == nil || *c.Ready) &&
		(c.Serving == nil || *c.Serving) &&
		(c.Terminating == nil || !*c.Terminating)
}

// rotate returns the addresses sorted, then turned so that successive dials
// start at successive endpoints; the rest follow for the agent to fall back on.
func (p *endpointPicker) rotate(set map[string]bool) []string {
	addrs := make([]string, 0, len(set))
	for a := range set {
		addrs = append(addrs, a)
	}
	sort.Strings(addrs)
	i := int(p.next.Add(1) % uint64(len(addrs)))
	return append(addrs[i:], addrs[:i]...)
}

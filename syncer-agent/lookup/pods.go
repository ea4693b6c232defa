package lookup

import (
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// cachedPod is all the agent keeps of a Pod: what it checks an endpoint
// against (vouch.go). The agent watches every Pod of the cluster, so the
// rest of a Pod, several kilobytes, is dropped as it arrives: a
// corev1.Pod, even emptied, is a 1.2 KB struct before its labels.
type cachedPod struct {
	// ObjectMeta holds the name, namespace, labels, resource version and
	// deletion timestamp only. It makes the type an object the informer's
	// store can key.
	metav1.ObjectMeta
	// hostNetwork: the Pod's addresses are its node's.
	hostNetwork bool
	// ended: in phase Succeeded or Failed, the Pod's sandbox is gone and
	// its addresses may be another Pod's by now.
	ended bool
	ips   []netip.Addr
}

// slimPod is the informer transform for Pods.
func slimPod(p *corev1.Pod) *cachedPod {
	c := &cachedPod{
		ObjectMeta: metav1.ObjectMeta{
			Name:              p.Name,
			Namespace:         p.Namespace,
			Labels:            p.Labels,
			ResourceVersion:   p.ResourceVersion,
			DeletionTimestamp: p.DeletionTimestamp,
		},
		hostNetwork: p.Spec.HostNetwork,
		ended:       p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed,
	}
	ips := p.Status.PodIPs
	if len(ips) == 0 && p.Status.PodIP != "" { // PodIPs[0] is PodIP; only old API servers lack PodIPs
		ips = []corev1.PodIP{{IP: p.Status.PodIP}}
	}
	for _, ip := range ips {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			c.ips = append(c.ips, a.Unmap())
		}
	}
	return c
}

// has reports whether ip is one of the Pod's addresses.
func (p *cachedPod) has(ip netip.Addr) bool { return slices.Contains(p.ips, ip.Unmap()) }

package lookup

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// refusedAddress says why the agent must not connect to ip, or "" if it may.
// An EndpointSlice is written by whoever can write it; these addresses would
// reach the agent's own host or the API server instead of a webhook pod.
func refusedAddress(ip netip.Addr, apiServer map[netip.Addr]bool) string {
	ip = ip.Unmap() // ::ffff:127.0.0.1 is loopback too
	switch {
	case !ip.IsValid():
		return "not an IP address"
	case ip.Zone() != "": // names an interface of the agent's host
		return "an address with an IPv6 zone"
	case ip.IsLoopback():
		return "a loopback address"
	case ip.IsLinkLocalUnicast():
		return "a link-local address"
	case ip.IsUnspecified():
		return "the unspecified address"
	case ip.IsMulticast(), ip.IsInterfaceLocalMulticast(), ip.IsLinkLocalMulticast():
		return "a multicast address"
	case ip == netip.AddrFrom4([4]byte{255, 255, 255, 255}):
		return "the broadcast address"
	case apiServer[ip]:
		return "an address of the Kubernetes API server"
	}
	return ""
}

// refusals collect why endpoints were refused, to explain a
// PermissionDenied. Whoever writes a Service's EndpointSlices decides how
// many there are: a dial formats a bounded number of reasons, and the
// explanation names a few distinct ones.
type refusals struct {
	reasons []string
	more    int // refusals past maxKept, counted only
}

const (
	// maxKept bounds the reasons a dial formats.
	maxKept = 64
	// maxReasons bounds a refusal's message (it travels in a gRPC status).
	maxReasons = 5
)

func (r *refusals) add(format string, args ...any) {
	if len(r.reasons) == maxKept {
		r.more++
		return
	}
	r.reasons = append(r.reasons, fmt.Sprintf(format, args...))
}

func (r *refusals) empty() bool { return len(r.reasons) == 0 }

// String lists distinct reasons, sorted, at most maxReasons of them.
func (r *refusals) String() string {
	reasons := slices.Compact(slices.Sorted(slices.Values(r.reasons))) // a Pod may be in two slices
	if more := len(reasons) - maxReasons + r.more; more > 0 {
		return fmt.Sprintf("%s; and %d more", strings.Join(reasons[:min(maxReasons, len(reasons))], "; "), more)
	}
	return strings.Join(reasons, "; ")
}

package lookup

import (
	"fmt"
	"net/netip"
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

// refusedError is a refused endpoint, kept to explain a PermissionDenied.
type refusedError struct {
	addr   string
	reason string
}

func (r refusedError) String() string { return fmt.Sprintf("%s is %s", r.addr, r.reason) }

package lookup

import (
	"net/netip"
	"testing"
)

func TestRefusedAddress(t *testing.T) {
	apiServer := map[netip.Addr]bool{netip.MustParseAddr("10.0.0.1"): true}
	for ip, refused := range map[string]bool{
		"10.1.0.1": false, "192.0.2.10": false, "2001:db8::1": false,
		"127.0.0.1": true, "127.255.0.9": true, "::1": true, "::ffff:127.0.0.1": true,
		"169.254.169.254": true, "fe80::1": true,
		"0.0.0.0": true, "::": true,
		"224.0.0.251": true, "239.1.2.3": true, "ff02::1": true, "ff01::1": true,
		"255.255.255.255": true,
		"10.0.0.1":        true, "::ffff:10.0.0.1": true, // the API server
		"2001:db8::1%eth0": true,
	} {
		why := refusedAddress(netip.MustParseAddr(ip), apiServer)
		if (why != "") != refused {
			t.Errorf("refusedAddress(%s) = %q, want refused %v", ip, why, refused)
		}
	}
}

package harness

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// FreePort is a loopback TCP port that was free a moment ago, for a child
// process to listen on. It is drawn from below the range the kernel hands
// out for port 0 and for outgoing connections: between this check and the
// child's bind, a port from that range may go to any process on the
// machine (make test runs packages side by side), one from below it only
// to another caller of FreePort that drew the same number.
func FreePort(t T) int {
	t.Helper()
	return FreePortOn(t, "127.0.0.1")
}

// FreePortOn is FreePort free on every one of hosts (loopback addresses),
// for replicas that share a port on several addresses.
func FreePortOn(t T, hosts ...string) int {
	t.Helper()
	low := ephemeralLow()
	for range 100 {
		port := 1024 + rand.IntN(low-1024)
		if freeOnAll(port, hosts) {
			return port
		}
	}
	t.Fatalf("no port below the ephemeral range free on %v in 100 tries", hosts)
	return 0
}

// freeOnAll says whether port can be listened on at every one of hosts.
func freeOnAll(port int, hosts []string) bool {
	for _, h := range hosts {
		l, err := net.Listen("tcp", net.JoinHostPort(h, strconv.Itoa(port)))
		if err != nil {
			return false
		}
		l.Close()
	}
	return true
}

// FreeAddr is FreePort as a loopback address.
func FreeAddr(t T) string {
	t.Helper()
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(FreePort(t)))
}

// ephemeralLow is the first port of the kernel's ephemeral range, 32768 if
// it cannot be read.
func ephemeralLow() int {
	const fallback = 32768
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return fallback
	}
	fields := strings.Fields(string(b))
	if len(fields) == 0 {
		return fallback
	}
	low, err := strconv.Atoi(fields[0])
	if err != nil || low <= 2048 {
		return fallback
	}
	return low
}

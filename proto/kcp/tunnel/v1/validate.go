package tunnelv1

import (
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
)

var (
	// kcp's logical cluster names: generated ones are 16 base36 characters,
	// "root" and friends are plain; "system:" names are kcp's own.
	clusterNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,61}[a-z0-9]$`)
	// DNS-1123 label, as Kubernetes requires of namespace names.
	dns1123LabelRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	// DNS-1035 label, as Kubernetes requires of Service names.
	dns1035LabelRE = regexp.MustCompile(`^[a-z]([-a-z0-9]*[a-z0-9])?$`)
)

const maxLabelLength = 63

// ValidateClusterName reports whether name is a kcp logical cluster name.
// Paths (root:org:ws) are not names: the broker routes by name.
func ValidateClusterName(name string) error {
	n := strings.TrimPrefix(name, "system:")
	if !clusterNameRE.MatchString(n) {
		return fmt.Errorf("logical cluster %s is not a valid logical cluster name (lower-case alphanumerics and '-', 2-63 characters, optionally prefixed with \"system:\"; a path such as root:org is not a name)", quoteShort(name))
	}
	return nil
}

// ValidateAgentName reports whether name may name an agent: empty, or a
// DNS-1123 label. The broker labels the agent's metrics with it.
func ValidateAgentName(name string) error {
	if name != "" && (len(name) > maxLabelLength || !dns1123LabelRE.MatchString(name)) {
		return fmt.Errorf("agent name %s is not a DNS-1123 label (lower-case alphanumerics and '-', at most 63 characters)", quoteShort(name))
	}
	return nil
}

// quoteShort quotes s for a message, cut short if it is long: a peer's
// input must not make a status message as long as the input.
func quoteShort(s string) string {
	const most = 80
	if len(s) <= most {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprintf("%q... (%d bytes)", s[:most], len(s))
}

// Validate reports the first problem with a dial target, in terms a caller can
// act on; nil if the target is well formed.
func (t *Target) Validate() error {
	if t == nil {
		return fmt.Errorf("no target: the first message of a dial must name a target")
	}
	if err := ValidateClusterName(t.GetCluster()); err != nil {
		return err
	}
	if t.GetIp() != "" {
		return t.validateAddress()
	}
	if ns := t.GetNamespace(); len(ns) > maxLabelLength || !dns1123LabelRE.MatchString(ns) {
		return fmt.Errorf("namespace %q is not a DNS-1123 label", ns)
	}
	if s := t.GetService(); len(s) > maxLabelLength || !dns1035LabelRE.MatchString(s) {
		return fmt.Errorf("service %q is not a DNS-1035 label", s)
	}
	if p := t.GetPort(); p < 1 || p > 65535 {
		return fmt.Errorf("port %d is outside 1-65535", p)
	}
	return nil
}

// validateAddress checks a target that names an address: one IP address,
// spelt the one way netip spells it (so that a target has one key), and a
// port, but no Service.
func (t *Target) validateAddress() error {
	ip, err := netip.ParseAddr(t.GetIp())
	switch {
	case err != nil:
		return fmt.Errorf("ip %s is not an IP address", quoteShort(t.GetIp()))
	case ip.Zone() != "":
		return fmt.Errorf("ip %s has an IPv6 zone, which names an interface of the agent's host", quoteShort(t.GetIp()))
	case ip.Is4In6():
		return fmt.Errorf("ip %s is an IPv4 address in IPv6 form: write it as %s", quoteShort(t.GetIp()), ip.Unmap())
	case ip.String() != t.GetIp():
		return fmt.Errorf("ip %s is not in canonical form (%s)", quoteShort(t.GetIp()), ip)
	case t.GetNamespace() != "" || t.GetService() != "":
		return fmt.Errorf("a target names either an ip or a namespace and service, not both")
	}
	if p := t.GetPort(); p < 1 || p > 65535 {
		return fmt.Errorf("port %d is outside 1-65535", p)
	}
	return nil
}

// Key is the target as cluster/namespace/service:port, the one way the
// project writes a target (kcpplugin's errors, tunnelctl, logs), and a map
// key: the parts of a valid target hold no '/', and the port follows the
// last ':', so two valid targets never share a key.
//
// A target that names an address is cluster/ip:port (IPv6 in brackets):
// one '/', so it never shares a key with a Service's.
func (t *Target) Key() string {
	if t.GetIp() != "" {
		return t.GetCluster() + "/" + net.JoinHostPort(t.GetIp(), strconv.FormatUint(uint64(t.GetPort()), 10))
	}
	return fmt.Sprintf("%s/%s/%s:%d", t.GetCluster(), t.GetNamespace(), t.GetService(), t.GetPort())
}

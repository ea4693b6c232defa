package tunnelv1

import (
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
)

// The naming rules of docs/protocol.md §7, written out character by
// character: an oracle that shares nothing with validate.go's regular
// expressions. (test/fuzz checks the labels against k8s.io/apimachinery as
// well; this module stays free of it.)

func isAlnum(c byte) bool { return 'a' <= c && c <= 'z' || '0' <= c && c <= '9' }

// isLabel: 1-63 of [a-z0-9-], alphanumeric at both ends, and a letter first
// if letterFirst.
func isLabel(s string, letterFirst bool) bool {
	if len(s) < 1 || len(s) > 63 || !isAlnum(s[0]) || !isAlnum(s[len(s)-1]) {
		return false
	}
	if letterFirst && !('a' <= s[0] && s[0] <= 'z') {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isAlnum(s[i]) && s[i] != '-' {
			return false
		}
	}
	return true
}

// isClusterName: after one optional "system:", a DNS-1123 label of 2-63.
func isClusterName(s string) bool {
	s = strings.TrimPrefix(s, "system:")
	return len(s) >= 2 && isLabel(s, false)
}

var targetSeeds = []struct {
	cluster, namespace, service string
	port                        uint32
}{
	{"root", "default", "webhook", 443},
	{"system:admin", "kube-system", "w", 1},
	{"1x2y3z4w5v6u7t8s", "0", "a0", 65535},
	{strings.Repeat("c", 63), strings.Repeat("n", 63), strings.Repeat("s", 63), 8443},
	{strings.Repeat("c", 64), "default", "webhook", 443},
	{"root", strings.Repeat("n", 64), "webhook", 443},
	{"root", "default", strings.Repeat("s", 64), 443},
	{"root:org", "default", "webhook", 443},
	{"Root", "default", "webhook", 443},
	{"r", "default", "webhook", 443},
	{"", "default", "webhook", 443},
	{"-root", "default", "webhook", 443},
	{"root-", "default", "webhook", 443},
	{"system:", "default", "webhook", 443},
	{"system:system:root", "default", "webhook", 443},
	{"root\n", "default", "webhook", 443},
	{"röot", "default", "webhook", 443},
	{"root", "-default", "webhook", 443},
	{"root", "default-", "webhook", 443},
	{"root", "", "webhook", 443},
	{"root", "default\n", "webhook", 443},
	{"root", "de_fault", "webhook", 443},
	{"root", "default", "9webhook", 443},
	{"root", "default", "web.hook", 443},
	{"root", "default", "Webhook", 443},
	{"root", "default", "webhook-", 443},
	{"root", "default", "", 443},
	{"root", "default", "webhook", 0},
	{"root", "default", "webhook", 65536},
	{"root", "default", "webhook", 1<<32 - 1},
}

// FuzzTargetValidate checks Target.Validate and ValidateClusterName against
// the rules: never a panic; a target is accepted exactly when each field
// obeys its rule; a refusal names the first field at fault.
func FuzzTargetValidate(f *testing.F) {
	for _, s := range targetSeeds {
		f.Add(s.cluster, s.namespace, s.service, s.port)
	}
	f.Fuzz(func(t *testing.T, cluster, namespace, service string, port uint32) {
		target := &Target{Cluster: cluster, Namespace: namespace, Service: service, Port: port}
		err := target.Validate()
		key := target.Key()
		// A valid target's key gives it back: no two valid targets share one.
		if err == nil && keyOf(key) != [4]string{cluster, namespace, service, strconv.FormatUint(uint64(port), 10)} {
			t.Fatalf("Key() = %q, which does not split into the target %v", key, target)
		}

		if got, want := ValidateClusterName(cluster) == nil, isClusterName(cluster); got != want {
			t.Fatalf("ValidateClusterName(%q) accepted=%v, want %v", cluster, got, want)
		}
		// The first field at fault, in the order Validate checks them.
		var fault string
		switch {
		case !isClusterName(cluster):
			fault = "logical cluster"
		case !isLabel(namespace, false):
			fault = "namespace"
		case !isLabel(service, true):
			fault = "service"
		case port < 1 || port > 65535:
			fault = "port"
		}
		switch {
		case fault == "" && err != nil:
			t.Fatalf("%+v refused: %v", target, err)
		case fault != "" && err == nil:
			t.Fatalf("%+v accepted, but its %s breaks the rules", target, fault)
		case fault != "" && !strings.HasPrefix(err.Error(), fault):
			t.Fatalf("%+v: error %q should be about the %s", target, err, fault)
		}
	})
}

// FuzzDialRequestDecode decodes arbitrary bytes as the first message of a
// Dial (and of a Connect's dial order), as the broker and the agent do, and
// validates the target: never a panic, and a target that passes keeps
// passing, unchanged, after a round trip through the wire format, which is
// how the broker hands it to the agent.
func FuzzDialRequestDecode(f *testing.F) {
	for _, s := range targetSeeds[:8] {
		target := &Target{Cluster: s.cluster, Namespace: s.namespace, Service: s.service, Port: s.port}
		for _, m := range []proto.Message{
			&DialRequest{Frame: &DialRequest_Target{Target: target}},
			&DialOrder{DialId: 7, Target: target, TimeoutMs: 5000},
		} {
			b, err := proto.Marshal(m)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(b)
		}
	}
	f.Add([]byte{0x12, 0x01, 'x'})                                // a data frame
	f.Add([]byte{0x0a, 0x02, 0x20, 0x00})                         // a target with port 0, spelled out
	f.Add([]byte{0x0a, 0x06, 0x20, 0xff, 0xff, 0xff, 0xff, 0x0f}) // port 2^32-1
	f.Add([]byte{0x0a, 0x00, 0x0a, 0x00})                         // two empty targets
	f.Fuzz(func(t *testing.T, b []byte) {
		var req DialRequest
		if proto.Unmarshal(b, &req) == nil {
			checkDecodedTarget(t, req.GetTarget())
		}
		var order DialOrder
		if proto.Unmarshal(b, &order) == nil {
			checkDecodedTarget(t, order.GetTarget())
		}
	})
}

func checkDecodedTarget(t *testing.T, target *Target) {
	t.Helper()
	if err := target.Validate(); err != nil {
		if target == nil && !strings.Contains(err.Error(), "no target") {
			t.Fatalf("a missing target: %v", err)
		}
		return
	}
	if !isClusterName(target.GetCluster()) || !namesOneThing(target) || target.GetPort() < 1 || target.GetPort() > 65535 {
		t.Fatalf("decoded target %v accepted against the rules", target)
	}
	wire, err := proto.Marshal(&DialOrder{DialId: 1, Target: target})
	if err != nil {
		t.Fatal(err)
	}
	var order DialOrder
	if err := proto.Unmarshal(wire, &order); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(order.GetTarget(), target) {
		t.Fatalf("target %v came back as %v", target, order.GetTarget())
	}
	if err := order.GetTarget().Validate(); err != nil {
		t.Fatalf("target %v refused after a round trip: %v", target, err)
	}
}

// namesOneThing: a Service (a namespace and a service label) or, without
// them, one IP address in netip's spelling.
func namesOneThing(target *Target) bool {
	if target.GetIp() == "" {
		return isLabel(target.GetNamespace(), false) && isLabel(target.GetService(), true)
	}
	ip, err := netip.ParseAddr(target.GetIp())
	return err == nil && ip.Zone() == "" && !ip.Is4In6() && ip.String() == target.GetIp() &&
		target.GetNamespace() == "" && target.GetService() == ""
}

// keyOf splits a target's key, cluster/namespace/service:port, at the last
// ':' and at the '/'s before it.
func keyOf(key string) [4]string {
	i := strings.LastIndex(key, ":")
	parts := strings.Split(key[:max(i, 0)], "/")
	if i < 0 || len(parts) != 3 {
		return [4]string{}
	}
	return [4]string{parts[0], parts[1], parts[2], key[i+1:]}
}

func TestAKeyIsClusterNamespaceServicePort(t *testing.T) {
	target := &Target{Cluster: "system:admin", Namespace: "default", Service: "webhook", Port: 443}
	if got, want := target.Key(), "system:admin/default/webhook:443"; got != want {
		t.Errorf("Key() = %q, want %q", got, want)
	}
}

func TestATargetNamesAServiceOrAnAddress(t *testing.T) {
	for _, c := range []struct {
		target *Target
		ok     bool
		key    string
	}{
		{&Target{Cluster: "root", Ip: "10.96.0.10", Port: 443}, true, "root/10.96.0.10:443"},
		{&Target{Cluster: "root", Ip: "fd00::a", Port: 8443}, true, "root/[fd00::a]:8443"},
		{&Target{Cluster: "root", Ip: "fd00:0::a", Port: 443}, false, ""},           // not canonical
		{&Target{Cluster: "root", Ip: "fe80::1%eth0", Port: 443}, false, ""},        // a zone
		{&Target{Cluster: "root", Ip: "010.96.0.10", Port: 443}, false, ""},         // not an address
		{&Target{Cluster: "root", Ip: "webhook.default.svc", Port: 443}, false, ""}, // a name
		{&Target{Cluster: "root", Ip: "10.96.0.10", Port: 0}, false, ""},
		{&Target{Cluster: "root", Ip: "::ffff:10.96.0.10", Port: 443}, false, ""}, // IPv4 in IPv6 form
		{&Target{Cluster: "root", Ip: "10.96.0.10", Namespace: "default", Service: "webhook", Port: 443}, false, ""},
		{&Target{Cluster: "root:org", Ip: "10.96.0.10", Port: 443}, false, ""},
	} {
		err := c.target.Validate()
		if (err == nil) != c.ok {
			t.Errorf("Validate(%v) = %v, want ok %v", c.target, err, c.ok)
		}
		if c.ok && c.target.Key() != c.key {
			t.Errorf("Key(%v) = %q, want %q", c.target, c.target.Key(), c.key)
		}
	}
}

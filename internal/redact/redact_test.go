package redact_test

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/kcp-dev/tunnel-broker/internal/redact"
)

func TestTextRemovesAddressesAndIdentities(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		// What Go's net package says when a connect fails.
		{"dial tcp 10.1.2.3:8443: connect: connection refused", "dial tcp <address>: connect: connection refused"},
		{"dial tcp [fd00::1]:443: connect: no route to host", "dial tcp <address>: connect: no route to host"},
		{"dial tcp [fe80::1%eth0]:443: i/o timeout", "dial tcp <address>: i/o timeout"},
		{"lookup webhook.default.svc on 10.96.0.10:53: no such host", "lookup webhook.default.svc on <address>: no such host"},
		{"read tcp 127.0.0.1:40000->10.0.0.7:8443: read: connection reset by peer", "read tcp <address>-><address>: read: connection reset by peer"},
		// Bare addresses, prefixes, mapped and glued ones.
		{"endpoint 2001:db8::5 is refused", "endpoint <address> is refused"},
		{"from ::ffff:10.0.0.1 and ::1", "from <address> and <address>"},
		{"pod network 10.244.0.0/16, service network fd00:10::/108", "pod network <address>, service network <address>"},
		{"ip=192.168.1.1,port=80", "ip=<address>,port=80"},
		{"host10.0.0.1", "host<address>"},
		// Host names with ports, URLs, SPIFFE IDs.
		{"broker at tunnel-broker-0.tunnel-broker.kcp-system.svc:8443 is gone", "broker at <address> is gone"},
		{"localhost:9090 refused", "<address> refused"},
		{`Post "https://10.0.0.1:6443/api/v1?x=1": EOF`, `Post "<url>": EOF`},
		{"agent spiffe://example.org/ns/kcp-syncer/sa/syncer-us-east-1 failed", "agent <url> failed"},
		{"refused (via spiffe://example.org/agent)", "refused (via <url>)"},
	} {
		if got := redact.Text(tc.in, 256); got != tc.want {
			t.Errorf("Text(%q)\n got %q\nwant %q", tc.in, got, tc.want)
		}
	}
}

func TestTextKeepsWhatACallerNeeds(t *testing.T) {
	for _, in := range []string{
		"connecting to Service default/webhook port 443: connection refused",
		"service default/webhook port 443 of logical cluster root: no such Service",
		"namespace kube-system belongs to a kcp syncer, not to logical cluster 2x3y4z5w6v7u8t9s",
		"connecting timed out after 4.5s at 12:30:45, ratio 3:2",
		"no service default/nope with port 80 in logical cluster root",
	} {
		if got := redact.Text(in, 256); got != in {
			t.Errorf("Text(%q) = %q, want it unchanged", in, got)
		}
	}
}

func TestTextMakesControlCharactersAndBadUTF8Spaces(t *testing.T) {
	in := "line one\r\n\tline two\x1b[31m red\x00\xff end  "
	if got, want := redact.Text(in, 256), "line one line two [31m red end"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

func TestTextIsBounded(t *testing.T) {
	for _, in := range []string{
		strings.Repeat("x", 900<<10),
		strings.Repeat("é", 300<<10),
		strings.Repeat("refused ", 100<<10),
		strings.Repeat(" ", 900<<10) + "10.0.0.1:8443",
		strings.Repeat("word ", 51) + "10.0.0.1:8443",
	} {
		got := redact.Text(in, 256)
		if len(got) > 256 || !utf8.ValidString(got) {
			t.Errorf("Text of %d bytes: %d bytes (valid UTF-8: %v), want at most 256", len(in), len(got), utf8.ValidString(got))
		}
		if strings.Contains(got, "10.0.") {
			t.Errorf("Text of %d bytes shows part of an address: %q", len(in), got)
		}
	}
	if got := redact.Text(strings.Repeat("refused ", 100), 32); got != "refused refused refused refus…" {
		t.Errorf("a cut text: got %q", got)
	}
}

// The start of a long text is scrubbed like a short one, and an address
// that the first cut goes through does not show in part.
func TestTextOfALongTextShowsNoPartOfAnAddress(t *testing.T) {
	for n := range 20 {
		in := strings.Repeat(" ", 1000+n) + "dial tcp 10.123.45.67:8443: refused"
		if got := redact.Text(in, 256); strings.ContainsAny(got, "0123456789") {
			t.Errorf("cut at %d: %q shows part of the address", n, got)
		}
	}
}

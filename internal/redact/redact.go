// Package redact makes text that a peer sent fit to show a caller: short,
// printable, and without the addresses and identities of what lies behind
// the tunnel. kcp shows a dial's error to its end users in admission
// errors, and the text may come from an agent the broker cannot trust.
//
// What it removes is what a peer says by accident, such as a raw Go error
// with a pod's address in it. A peer that means to leak something can spell
// it out in words; against such a peer, Text bounds the length and keeps
// the text printable.
package redact

import (
	"net/netip"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Placeholders for what Text removes.
const (
	Address = "<address>"
	URL     = "<url>"
)

// Ellipsis ends a text that Text cut short.
const Ellipsis = "…"

var (
	// A URL of any scheme, SPIFFE IDs included, up to a space, a quote or
	// a bracket (as in prose: "(via spiffe://example.org/agent)").
	urlRE = regexp.MustCompile(`[A-Za-z][A-Za-z0-9+.-]*://[^\s"'<>()]*`)
	// An IPv6 address in brackets, as in a host:port, with its port.
	bracketedRE = regexp.MustCompile(`\[[0-9A-Za-z:.%_-]*\](?::[0-9]{1,5})?`)
	// An IPv4 address, maybe with a prefix length or a port. Not bounded
	// by \b: an address glued to a word is an address all the same.
	ipv4RE = regexp.MustCompile(`[0-9]{1,3}(?:\.[0-9]{1,3}){3}(?:/[0-9]{1,2}|:[0-9]{1,5})?`)
	// Something that may be an IPv6 address: netip decides.
	ipv6RE = regexp.MustCompile(`[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?:[0-9.]*)(?:%[0-9A-Za-z_.-]+)?(?:/[0-9]{1,3})?`)
	// A host name with a port.
	hostPortRE = regexp.MustCompile(`\b[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?:[0-9]{1,5}\b`)
	spacesRE   = regexp.MustCompile(`\s+`)
)

// Text returns s with every URL (SPIFFE IDs included) replaced by URL, every
// IP address and host:port by Address, control characters and runs of
// spaces by one space, and invalid UTF-8 dropped; cut to at most limit bytes,
// ending in Ellipsis if it was cut.
func Text(s string, limit int) string {
	// Only the start of a long text can show: scrub only that, minus the
	// word the cut went through (if it is not the only one), which might
	// be the start of an address.
	long := len(s) > 4*limit+64
	if long {
		s = s[:4*limit+64]
	}
	s = strings.ToValidUTF8(s, "")
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) || !unicode.IsPrint(r) {
			return ' '
		}
		return r
	}, s)
	if i := strings.LastIndexByte(s, ' '); long && i > 0 {
		s = s[:i]
	}
	s = urlRE.ReplaceAllString(s, URL)
	s = bracketedRE.ReplaceAllString(s, Address)
	s = ipv6RE.ReplaceAllStringFunc(s, func(m string) string {
		if _, err := netip.ParseAddr(m); err == nil {
			return Address
		}
		if _, err := netip.ParsePrefix(m); err == nil {
			return Address
		}
		return m
	})
	s = ipv4RE.ReplaceAllString(s, Address)
	s = hostPortRE.ReplaceAllStringFunc(s, func(m string) string {
		host := m[:strings.LastIndexByte(m, ':')]
		if strings.IndexFunc(host, unicode.IsLetter) < 0 {
			return m // a time of day, a ratio: not a host
		}
		return Address
	})
	s = strings.TrimSpace(spacesRE.ReplaceAllString(s, " "))
	return cut(s, limit)
}

// cut shortens s to at most limit bytes, on a rune boundary, marking the cut.
func cut(s string, limit int) string {
	if len(s) <= limit {
		return s
	}
	end := limit - len(Ellipsis)
	if end <= 0 {
		return ""
	}
	for end > 0 && !utf8.RuneStart(s[end]) {
		end--
	}
	return strings.TrimRight(s[:end], " ") + Ellipsis
}

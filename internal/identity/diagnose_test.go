package identity

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

// A client whose certificate the server refuses learns it from its own
// handshake, as the TLS alert the server sent, not from a later write's
// "broken pipe"; and it can say what is wrong with its own SVID.
func TestAClientWhoseCertificateIsRefusedHearsTheAlertAndCanSayWhy(t *testing.T) {
	ca, stranger := newCA(t, "ca"), newCA(t, "stranger")
	broker := newSource(t, ca, devca.Leaf{SPIFFEID: "/broker"})
	addr, results := serve(t, ServerCredentials(broker, tlsconfig.AuthorizeAny()))
	authorizeBroker := tlsconfig.AuthorizeID(spiffeid.RequireFromString("spiffe://" + testTD + "/broker"))

	client := newSource(t, stranger, devca.Leaf{SPIFFEID: "/agent"})
	client.trustOnly(ca)
	_, _, err := clientHandshake(t, ClientCredentials(client, authorizeBroker), addr)
	next(t, results)
	if err == nil || !strings.Contains(err.Error(), "remote error: tls: bad certificate") {
		t.Fatalf("handshake: %v, want the server's alert: bad certificate", err)
	}
	p, ok := DiagnoseOwn(client, err, time.Now())
	if !ok || p.Expired || p.PeerAlert != "bad certificate" || p.ID.String() != "spiffe://"+testTD+"/agent" {
		t.Errorf("DiagnoseOwn: %+v %v, want refused with bad certificate, not expired, naming the SVID", p, ok)
	}

	// Expired: said whatever the error, and with its expiry.
	expiry := time.Now().Add(-time.Minute).Truncate(time.Second)
	old := newSource(t, ca, devca.Leaf{SPIFFEID: "/agent", NotBefore: expiry.Add(-time.Hour), NotAfter: expiry})
	_, _, err = clientHandshake(t, ClientCredentials(old, authorizeBroker), addr)
	next(t, results)
	p, ok = DiagnoseOwn(old, err, time.Now())
	if !ok || !p.Expired || !p.NotAfter.Equal(expiry) {
		t.Errorf("DiagnoseOwn of an expired SVID (%v): %+v %v, want expired at %v", err, p, ok, expiry)
	}

	// Admitted: nothing to say, and the server's first bytes, read during
	// the handshake, are the connection's first bytes.
	good := newSource(t, ca, devca.Leaf{SPIFFEID: "/agent"})
	conn, _, err := clientHandshake(t, ClientCredentials(good, authorizeBroker), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	next(t, results)
	first := make([]byte, 1)
	if _, err := io.ReadFull(conn, first); err != nil || first[0] != 1 {
		t.Errorf("first byte: %v %v, want the server's 1", first, err)
	}
	if p, ok := DiagnoseOwn(good, nil, time.Now()); ok {
		t.Errorf("DiagnoseOwn of a valid, admitted SVID: %+v", p)
	}
}

func TestPeerAlertFindsOnlyCertificateAlerts(t *testing.T) {
	for msg, want := range map[string]string{
		`connection error: desc = "transport: authentication handshake failed: remote error: tls: bad certificate"`: "bad certificate",
		`remote error: tls: unknown certificate authority`:                                                          "unknown certificate authority",
		`remote error: tls: handshake failure`:                                                                      "",
		`tls: failed to verify certificate: x509: certificate signed by unknown authority`:                          "",
		`write: broken pipe`: "",
	} {
		if got := PeerAlert(msg); got != want {
			t.Errorf("PeerAlert(%q) = %q, want %q", msg, got, want)
		}
	}
}

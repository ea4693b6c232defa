package identity

import (
	"strings"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// OwnProblem is what is wrong with a process's own identity when its
// connection to a peer fails: the process holds its SVID, so it can say
// so itself rather than leave it to the peer's log.
type OwnProblem struct {
	// ID is the SPIFFE ID of the SVID presented, and NotAfter its expiry.
	ID       spiffeid.ID
	NotAfter time.Time
	// Expired: the SVID had expired when the connection failed.
	Expired bool
	// PeerAlert is the TLS alert with which the peer refused the
	// certificate, in crypto/tls's words ("bad certificate", "expired
	// certificate", "unknown certificate authority"); empty if it did not.
	PeerAlert string
}

// DiagnoseOwn says what is wrong with src's SVID, given why a connection
// failed (err, or its text as gRPC reports it): it has expired (checked
// first, whatever err says: an expired SVID fails every handshake), or the
// peer refused the certificate with a TLS alert. ok is false when neither
// is the case.
func DiagnoseOwn(src x509svid.Source, err error, now time.Time) (p OwnProblem, ok bool) {
	if src != nil {
		if svid, serr := src.GetX509SVID(); serr == nil && svid != nil && len(svid.Certificates) > 0 {
			p.ID, p.NotAfter = svid.ID, svid.Certificates[0].NotAfter
			p.Expired = now.After(p.NotAfter)
		}
	}
	if err != nil {
		p.PeerAlert = PeerAlert(err.Error())
	}
	return p, p.Expired || p.PeerAlert != ""
}

// certificateAlerts are the TLS alerts a peer sends when it refuses the
// certificate it was shown, as crypto/tls words them. The broker sends
// "bad certificate" for every refusal (its log says which).
var certificateAlerts = []string{
	"bad certificate", "expired certificate", "unknown certificate authority",
	"unknown certificate", "certificate required", "unsupported certificate",
	"revoked certificate", "access denied",
}

// PeerAlert is the certificate alert a peer sent, found in the text of an
// error ("remote error: tls: bad certificate"), or "".
func PeerAlert(msg string) string {
	const remote = "remote error: tls: "
	i := strings.Index(msg, remote)
	if i < 0 {
		return ""
	}
	rest := msg[i+len(remote):]
	for _, a := range certificateAlerts {
		if strings.HasPrefix(rest, a) {
			return a
		}
	}
	return ""
}

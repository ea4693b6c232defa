package kcpplugin

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"io"
	"math/big"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	grpcpeer "google.golang.org/grpc/peer"

	"github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1/wire"
)

// mtlsConfigs are a server's and a client's TLS configs that trust each
// other: both present one self-signed certificate.
type mtlsConfigs struct{ server, client *tls.Config }

func selfSignedMTLS(t *testing.T) mtlsConfigs {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), DNSNames: []string{"broker.test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	cert := []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}}
	return mtlsConfigs{
		server: &tls.Config{Certificates: cert, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert},
		client: &tls.Config{Certificates: cert, RootCAs: pool, ServerName: "broker.test"},
	}
}

// TestDialerOverMTLSWithTheSharedTransportSettings runs the Dialer as kcp
// does: the broker's Dial over mTLS with the transport settings of package
// wire (the 256 KiB write buffer, fixed windows) on both sides. The server
// reads the caller's certificate from the peer's AuthInfo.
func TestDialerOverMTLSWithTheSharedTransportSettings(t *testing.T) {
	certs := selfSignedMTLS(t)
	var peerCerts atomic.Int32
	handle := establish(func(p *peer) error {
		if gp, ok := grpcpeer.FromContext(p.ctx()); ok {
			if ti, ok := gp.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.PeerCertificates) == 1 {
				peerCerts.Add(1)
			}
		}
		return p.echo()
	})
	dialer := serveFakeBrokerWith(t, handle,
		append(wire.ServerOptions(wire.WindowSize), grpc.Creds(credentials.NewTLS(certs.server))),
		DialOptions(credentials.NewTLS(certs.client))...)
	c := dial(t, dialer)
	if err := c.SetDeadline(time.Now().Add(waitLong)); err != nil {
		t.Fatal(err)
	}

	data := make([]byte, 8<<20)
	for i := range data {
		data[i] = byte(i * 7)
	}
	got := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(c)
		got <- b
	}()
	if _, err := c.Write(data); err != nil {
		t.Fatal(err)
	}
	closeWrite(t, c)
	if !bytes.Equal(<-got, data) {
		t.Fatal("the echo differs from what was sent")
	}
	if peerCerts.Load() != 1 {
		t.Error("the server did not find the caller's certificate in the peer's credentials.TLSInfo")
	}
}

package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// mutualTLS is mTLS with the SVID in certFile and keyFile, trusting only the
// bundle, and accepting only a peer whose certificate names peerID: as a
// server it requires client certificates, as a client it checks the
// server's, as production mTLS between SPIFFE workloads does.
func mutualTLS(certFile, keyFile, bundleFile, peerID string) (*tls.Config, error) {
	if peerID == "" {
		return nil, errors.New("-peer-id is required")
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	pem, err := os.ReadFile(bundleFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no certificates", bundleFile)
	}
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		RootCAs:      pool,
		ClientCAs:    pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS12,
		// Runs after the chain was verified, on both sides.
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 || spiffeID(cs.PeerCertificates[0]) != peerID {
				return fmt.Errorf("peer is not %s", peerID)
			}
			return nil
		},
	}, nil
}

// spiffeID is the certificate's SPIFFE ID: an SVID has exactly one URI SAN,
// spiffe://; anything else has none.
func spiffeID(c *x509.Certificate) string {
	if len(c.URIs) != 1 || c.URIs[0].Scheme != "spiffe" {
		return ""
	}
	return c.URIs[0].String()
}

package wire

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"testing"
)

// notifiedPair is a TLS connection over a Socket, and its peer.
func notifiedPair(t *testing.T) (ours net.Conn, sock *Socket, theirs *tls.Conn) {
	t.Helper()
	tt := newTestTLS(t, tls.VersionTLS13)
	a, b := net.Pipe()
	sock = &Socket{Conn: a}
	client := tls.Client(sock, tt.client)
	theirs = tls.Server(b, tt.server)
	done := make(chan error, 1)
	go func() { done <- theirs.Handshake() }()
	if err := client.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// The pipes, not the TLS connections: a close_notify nobody reads
	// would wait out its write deadline.
	t.Cleanup(func() { a.Close(); b.Close() })
	return CloseNotified(client, sock), sock, theirs
}

func TestCloseNotifiedTellsACloseNotifyFromASocketThatEnded(t *testing.T) {
	ours, _, theirs := notifiedPair(t)
	go func() { theirs.CloseWrite() }()
	if _, err := ours.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("after a close_notify: %v, want io.EOF", err)
	}

	ours, _, theirs = notifiedPair(t)
	go func() { theirs.NetConn().Close() }()
	if _, err := ours.Read(make([]byte, 1)); !errors.Is(err, ErrNoCloseNotify) {
		t.Fatalf("after the socket ended without one: %v, want ErrNoCloseNotify", err)
	}
}

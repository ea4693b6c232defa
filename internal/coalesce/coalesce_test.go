package coalesce

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/credentials"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// waitLong bounds every wait; hitting it means a hang.
const waitLong = 20 * time.Second

// Most tests run real TLS (crypto/tls, through gRPC's TLS credentials) over
// loopback TCP, with the socket under TLS wrapped to count its writes; the
// last ones drive a holdConn by hand.

const tlsTestName = "coalesce.test"

// testTLS is a self-signed certificate for tlsTestName, used by both sides
// (mTLS), and the configs that trust it.
type testTLS struct {
	cert   tls.Certificate
	server *tls.Config
	client *tls.Config
}

func newTestTLS(t testing.TB, version uint16) *testTLS {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: tlsTestName},
		DNSNames:              []string{tlsTestName},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
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
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
	return &testTLS{
		cert: cert,
		server: &tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: pool,
			ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: version, MaxVersion: version},
		client: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, ServerName: tlsTestName,
			MinVersion: version, MaxVersion: version},
	}
}

// countingConn counts the writes that reach a socket.
type countingConn struct {
	net.Conn
	writes atomic.Int64
	bytes  atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	n, err := c.Conn.Write(p)
	c.bytes.Add(int64(n))
	return n, err
}

// tlsPair is both ends of a TLS connection over loopback TCP, each secured
// by the given credentials, with each side's socket counted.
type tlsPair struct {
	client, server         net.Conn
	clientInfo, serverInfo credentials.AuthInfo
	clientRaw, serverRaw   *countingConn
}

func newTLSPair(t testing.TB, clientCreds, serverCreds credentials.TransportCredentials) *tlsPair {
	t.Helper()
	p, err := handshakePair(clientCreds, serverCreds)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.client.Close()
		p.server.Close()
	})
	return p
}

// handshakePair connects over loopback and runs both handshakes at once.
func handshakePair(clientCreds, serverCreds credentials.TransportCredentials) (*tlsPair, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	defer lis.Close()
	p := &tlsPair{}
	var serverErr error
	served := make(chan struct{})
	go func() {
		defer close(served)
		raw, err := lis.Accept()
		if err != nil {
			serverErr = err
			return
		}
		p.serverRaw = &countingConn{Conn: raw}
		p.server, p.serverInfo, serverErr = serverCreds.ServerHandshake(p.serverRaw)
		if serverErr != nil {
			raw.Close()
		}
	}()
	raw, err := net.Dial("tcp", lis.Addr().String())
	if err != nil {
		<-served
		return nil, err
	}
	p.clientRaw = &countingConn{Conn: raw}
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	defer cancel()
	var clientErr error
	p.client, p.clientInfo, clientErr = clientCreds.ClientHandshake(ctx, tlsTestName, p.clientRaw)
	if clientErr != nil {
		raw.Close()
	}
	<-served
	if err := errors.Join(clientErr, serverErr); err != nil {
		if p.server != nil {
			p.server.Close()
		}
		if p.client != nil {
			p.client.Close()
		}
		return nil, err
	}
	return p, nil
}

func coalescedPair(t testing.TB, tt *testTLS) *tlsPair {
	t.Helper()
	return newTLSPair(t, Writes(credentials.NewTLS(tt.client)), Writes(credentials.NewTLS(tt.server)))
}

// chunk is what writer w sends as its seq-th message: a header (writer,
// seq, length) and a body derived from them, so a reader can check every
// byte. Sizes run from a few bytes (one record) to 300 KiB (many records).
func chunk(w, seq int) []byte {
	sizes := []int{1, 100, 16 << 10, 16<<10 + 1, 40 << 10, 256 << 10, 300 << 10}
	n := sizes[(w+seq)%len(sizes)]
	b := make([]byte, 12+n)
	binary.BigEndian.PutUint32(b[0:], uint32(w))
	binary.BigEndian.PutUint32(b[4:], uint32(seq))
	binary.BigEndian.PutUint32(b[8:], uint32(n))
	for i := range n {
		b[12+i] = byte(w*31 + seq*7 + i)
	}
	return b
}

// readChunks reads chunks until it has want of them (or, if want < 0, until
// the connection ends), checking each against chunk and that every writer's
// chunks come in order. It returns how many it read per writer, and the
// error that stopped it.
func readChunks(c net.Conn, writers, want int) ([]int, error) {
	next := make([]int, writers)
	header := make([]byte, 12)
	for read := 0; want < 0 || read < want; read++ {
		if _, err := io.ReadFull(c, header); err != nil {
			return next, err
		}
		w := int(binary.BigEndian.Uint32(header[0:]))
		seq := int(binary.BigEndian.Uint32(header[4:]))
		n := int(binary.BigEndian.Uint32(header[8:]))
		if w >= writers || seq != next[w] {
			return next, fmt.Errorf("corrupted: header says chunk %d of writer %d", seq, w)
		}
		body := make([]byte, n)
		if _, err := io.ReadFull(c, body); err != nil {
			return next, err
		}
		if want := chunk(w, seq); n != len(want)-12 || !bytes.Equal(body, want[12:]) {
			return next, fmt.Errorf("corrupted: body of chunk %d of writer %d", seq, w)
		}
		next[w]++
	}
	return next, nil
}

// writeChunks has writers goroutines write count chunks each to c, all at
// once.
func writeChunks(c net.Conn, writers, count int) error {
	errs := make(chan error, writers)
	for w := range writers {
		go func() {
			for seq := range count {
				if _, err := c.Write(chunk(w, seq)); err != nil {
					errs <- fmt.Errorf("writer %d, chunk %d: %w", w, seq, err)
					return
				}
			}
			errs <- nil
		}()
	}
	var all error
	for range writers {
		all = errors.Join(all, <-errs)
	}
	return all
}

func TestCoalescedTLSCarriesBytesBothWaysWithConcurrentWriters(t *testing.T) {
	for _, v := range []struct {
		name    string
		version uint16
	}{{"TLS1.3", tls.VersionTLS13}, {"TLS1.2", tls.VersionTLS12}} {
		t.Run(v.name, func(t *testing.T) {
			p := coalescedPair(t, newTestTLS(t, v.version))
			// Deadlines turn a hang into a failure.
			for _, c := range []net.Conn{p.client, p.server} {
				if err := c.SetDeadline(time.Now().Add(waitLong)); err != nil {
					t.Fatal(err)
				}
			}
			const writers, count = 4, 30
			var wg sync.WaitGroup
			for _, dir := range []struct {
				name     string
				from, to net.Conn
			}{{"client to server", p.client, p.server}, {"server to client", p.server, p.client}} {
				wg.Go(func() {
					if err := writeChunks(dir.from, writers, count); err != nil {
						t.Errorf("%s: %v", dir.name, err)
					}
				})
				wg.Go(func() {
					if _, err := readChunks(dir.to, writers, writers*count); err != nil {
						t.Errorf("%s: %v", dir.name, err)
					}
				})
			}
			wg.Wait()
		})
	}
}

func TestLargeWriteReachesTheSocketInOneWrite(t *testing.T) {
	tt := newTestTLS(t, tls.VersionTLS13)
	for _, tc := range []largeWrite{
		{"coalesced", true, 1},
		// Plain TLS, for contrast: one write per record, 16 KiB each at most.
		{"plain", false, 1 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.pair(t, tt)
			tc.check(t, p)
			wantSmallWriteSentAsIs(t, p)
		})
	}
}

// largeWrite is one case of TestLargeWriteReachesTheSocketInOneWrite: TLS
// with or without Writes.
type largeWrite struct {
	name     string
	coalesce bool
	// The most socket writes a 256 KiB Write may take.
	maxWrites int64
}

// pair connects a client and a server over TLS, both coalescing their
// writes if the case does.
func (tc largeWrite) pair(t *testing.T, tt *testTLS) *tlsPair {
	wrap := func(c credentials.TransportCredentials) credentials.TransportCredentials { return c }
	if tc.coalesce {
		wrap = Writes
	}
	return newTLSPair(t, wrap(credentials.NewTLS(tt.client)), wrap(credentials.NewTLS(tt.server)))
}

// check writes 256 KiB from the client and wants the server to read them
// intact, in at most the case's socket writes. Plain TLS must take at
// least one write per 16 KiB record, or the count itself is broken; and
// more bytes than the data must reach the socket, since records add
// their headers.
func (tc largeWrite) check(t *testing.T, p *tlsPair) {
	data := make([]byte, 256<<10)
	for i := range data {
		data[i] = byte(i * 13)
	}
	got := make(chan []byte, 1)
	go func() {
		b := make([]byte, len(data))
		_, _ = io.ReadFull(p.server, b)
		got <- b
	}()
	before, beforeBytes := p.clientRaw.writes.Load(), p.clientRaw.bytes.Load()
	if n, err := p.client.Write(data); n != len(data) || err != nil {
		t.Fatalf("Write: %d, %v", n, err)
	}
	writes, sent := p.clientRaw.writes.Load()-before, p.clientRaw.bytes.Load()-beforeBytes
	if !bytes.Equal(<-got, data) {
		t.Fatal("the peer read other bytes than were written")
	}
	if writes > tc.maxWrites {
		t.Errorf("256 KiB took %d socket writes (%d bytes); want at most %d", writes, sent, tc.maxWrites)
	}
	if !tc.coalesce && writes < 16 {
		t.Errorf("plain TLS took %d socket writes for 256 KiB; the count is wrong", writes)
	}
	if sent <= int64(len(data)) {
		t.Errorf("%d bytes reached the socket for %d of data", sent, len(data))
	}
}

// wantSmallWriteSentAsIs wants a small Write, one record, to reach the
// socket in one write and the server intact.
func wantSmallWriteSentAsIs(t *testing.T, p *tlsPair) {
	before := p.clientRaw.writes.Load()
	if _, err := p.client.Write([]byte("small")); err != nil {
		t.Fatal(err)
	}
	if writes := p.clientRaw.writes.Load() - before; writes != 1 {
		t.Errorf("a 5-byte write took %d socket writes", writes)
	}
	b := make([]byte, 5)
	if _, err := io.ReadFull(p.server, b); err != nil || string(b) != "small" {
		t.Fatalf("read %q, %v", b, err)
	}
}

func TestHandshakeAndAuthInfoAreTheWrappedCredentials(t *testing.T) {
	tt := newTestTLS(t, tls.VersionTLS13)
	inner := credentials.NewTLS(tt.client)
	creds := Writes(inner)
	if creds.Info() != inner.Info() {
		t.Errorf("Info() = %+v, want the wrapped %+v", creds.Info(), inner.Info())
	}
	clone := creds.Clone()
	if _, ok := clone.(*coalescingCreds); !ok {
		t.Fatalf("Clone() is %T, not coalescing", clone)
	}
	// The clone handshakes, and both sides see the peer's certificate in a
	// credentials.TLSInfo, which is what SPIFFE IDs are read from.
	p := newTLSPair(t, clone, Writes(credentials.NewTLS(tt.server)))
	for side, info := range map[string]credentials.AuthInfo{"client": p.clientInfo, "server": p.serverInfo} {
		ti, ok := info.(credentials.TLSInfo)
		if !ok {
			t.Fatalf("%s's AuthInfo is %T, want credentials.TLSInfo", side, info)
		}
		if certs := ti.State.PeerCertificates; len(certs) != 1 || !certs[0].Equal(tt.cert.Leaf) {
			t.Errorf("%s sees peer certificates %v", side, certs)
		}
		if ti.State.Version != tls.VersionTLS13 || !ti.State.HandshakeComplete {
			t.Errorf("%s's TLS state: version %x, handshake complete %v", side, ti.State.Version, ti.State.HandshakeComplete)
		}
	}

	// A handshake the peer refuses fails as the wrapped credentials' does.
	other := newTestTLS(t, tls.VersionTLS13)
	if _, err := handshakePair(Writes(credentials.NewTLS(other.client)), Writes(credentials.NewTLS(tt.server))); err == nil {
		t.Error("a handshake with an untrusted certificate succeeded")
	}
}

// cleanEnd says whether err is how a reader may see its peer close during a
// write: a close_notify (io.EOF), or the connection cut short. Anything else,
// such as a TLS record that fails to decrypt, means records went out of order.
func cleanEnd(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

func TestCloseDuringWritesEndsCleanly(t *testing.T) {
	tt := newTestTLS(t, tls.VersionTLS13)
	for i := range 20 {
		p := coalescedPair(t, tt)
		const writers = 4
		read := make(chan error, 1)
		go func() {
			_, err := readChunks(p.server, writers, -1)
			read <- err
		}()
		wrote := make(chan error, 1)
		go func() { wrote <- writeChunks(p.client, writers, 1<<20) }()
		// Close at a different point of the writes each time.
		time.Sleep(time.Duration(i%5) * time.Millisecond)
		_ = p.client.Close()
		if err := <-wrote; err == nil {
			t.Fatal("writes went on after Close")
		}
		select {
		case err := <-read:
			if !cleanEnd(err) {
				t.Fatalf("run %d: the reader saw %v", i, err)
			}
		case <-time.After(waitLong):
			t.Fatal("the reader did not see the close")
		}
	}
}

func TestCloseBreaksAWriteBlockedOnTheSocket(t *testing.T) {
	p := coalescedPair(t, newTestTLS(t, tls.VersionTLS13))
	// The server reads nothing, so the socket's buffers fill and a write
	// blocks.
	wrote := make(chan error, 1)
	go func() {
		big := make([]byte, 1<<20)
		for {
			if _, err := p.client.Write(big); err != nil {
				wrote <- err
				return
			}
		}
	}()
	// Wait until a write has been blocked for a while.
	for last := int64(-1); ; {
		time.Sleep(100 * time.Millisecond)
		now := p.clientRaw.bytes.Load()
		if now == last {
			break
		}
		last = now
	}
	start := time.Now()
	if err := p.client.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	select {
	case <-wrote:
	case <-time.After(waitLong):
		t.Fatal("the blocked write did not end")
	}
	// crypto/tls would wait up to 5 s to send close_notify behind the write.
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Close and the end of the blocked write took %v", took)
	}
}

// scriptedConn is a socket that records each write and can block them.
type scriptedConn struct {
	net.Conn
	mu      sync.Mutex
	writes  []string
	gate    chan struct{} // if not nil, writes wait for it to close
	entered chan struct{}
}

func (c *scriptedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	gate, entered := c.gate, c.entered
	c.mu.Unlock()
	if entered != nil {
		entered <- struct{}{}
	}
	if gate != nil {
		<-gate
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.writes = append(c.writes, string(p))
	return len(p), nil
}

func (c *scriptedConn) written() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.writes...)
}

func TestRecordsKeepTheirOrderAroundHeldRecords(t *testing.T) {
	sock := &scriptedConn{}
	h := &holdConn{Conn: sock}

	// Records written while holding go out together, on flush.
	h.Write([]byte("handshake"))
	h.start(100)
	h.Write([]byte("a1"))
	h.Write([]byte("a2"))
	// A record of another writer (an alert, a key update) joins them.
	h.Write([]byte("alert"))
	if got := sock.written(); len(got) != 1 {
		t.Fatalf("held records reached the socket before flush: %q", got)
	}
	if err := h.flush(); err != nil {
		t.Fatal(err)
	}
	// One that comes while held records are being sent waits for them.
	h.start(100)
	h.Write([]byte("b1"))
	sock.mu.Lock()
	sock.gate, sock.entered = make(chan struct{}), make(chan struct{})
	sock.mu.Unlock()
	flushed := make(chan error, 1)
	go func() { flushed <- h.flush() }()
	<-sock.entered // the flush is in the socket's write
	sock.mu.Lock()
	sock.entered = nil
	sock.mu.Unlock()
	late := make(chan struct{})
	go func() {
		h.Write([]byte("late"))
		close(late)
	}()
	select {
	case <-late:
		t.Fatal("a record overtook held records being sent")
	case <-time.After(50 * time.Millisecond):
	}
	close(sock.gate)
	if err := <-flushed; err != nil {
		t.Fatal(err)
	}
	<-late
	want := []string{"handshake", "a1a2alert", "b1", "late"}
	if got := sock.written(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("socket writes %q, want %q", got, want)
	}
}

// failOnceConn is a socket whose first write fails, as one cut short by a
// write deadline does; later ones would succeed.
type failOnceConn struct {
	scriptedConn
	failed bool
}

func (c *failOnceConn) Write(p []byte) (int, error) {
	if !c.failed {
		c.failed = true
		return 0, os.ErrDeadlineExceeded
	}
	return c.scriptedConn.Write(p)
}

func TestFailedFlushFailsLaterWrites(t *testing.T) {
	sock := &failOnceConn{}
	h := &holdConn{Conn: sock}
	h.start(10)
	h.Write([]byte("lost"))
	if err := h.flush(); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("flush: %v", err)
	}
	// Records after lost ones would not decrypt: none may follow.
	if _, err := h.Write([]byte("next")); err == nil {
		t.Error("a write after a failed flush succeeded")
	}
	h.start(10)
	h.Write([]byte("held"))
	if err := h.flush(); err == nil {
		t.Error("a flush after a failed flush succeeded")
	}
	if got := sock.written(); len(got) != 0 {
		t.Errorf("socket writes after the failed one: %q", got)
	}
}

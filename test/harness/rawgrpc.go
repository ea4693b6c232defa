package harness

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// RawConn is an HTTP/2 connection that speaks gRPC by hand, as a hostile
// peer would: it opens streams and sends exactly the bytes and frames it is
// told (half a message, a message split into 1-byte frames, bytes that are
// not protobuf), which a gRPC client never does. It keeps HTTP/2's flow
// control and answers SETTINGS and PINGs, so the server sees a well-behaved
// connection carrying ill-behaved streams.
type RawConn struct {
	// Padding is how many bytes of padding (0-255) each DATA frame
	// carries, which no gRPC client sends; flow control counts them. Set it
	// before writing.
	Padding uint8

	conn net.Conn

	wmu sync.Mutex // one writer of frames at a time; stream ids in order
	bw  *bufio.Writer
	fr  *http2.Framer
	enc *hpack.Encoder
	hb  bytes.Buffer
	ids uint32

	mu         sync.Mutex
	cond       *sync.Cond
	connWindow int64
	initWindow int64
	maxStreams uint32
	streams    map[uint32]*RawStream
	err        error // set when the connection is gone
	done       chan struct{}
}

// RawStream is one stream of a RawConn.
type RawStream struct {
	c      *RawConn
	id     uint32
	window int64 // guarded by c.mu
	sent   int64 // bytes of data written to the connection, guarded by c.mu
	ended  chan struct{}
	status *status.Status // set before ended closes
	data   bytes.Buffer   // what the server sent, guarded by c.mu
}

// RawConn connects to the gRPC server at addr with the SVID of path,
// expecting a server of the dev trust domain.
func (e *Env) RawConn(addr, path string) *RawConn {
	e.T.Helper()
	src := e.Identity(path)
	cfg := tlsconfig.MTLSClientConfig(src, src, tlsconfig.AuthorizeMemberOf(src.ID().TrustDomain()))
	cfg.NextProtos = []string{"h2"}
	c, err := DialRaw(addr, cfg)
	if err != nil {
		e.T.Fatal(err)
	}
	e.T.Cleanup(c.Close)
	return c
}

// DialRaw opens a RawConn over TLS with cfg (which must offer "h2").
func DialRaw(addr string, cfg *tls.Config) (*RawConn, error) {
	d := tls.Dialer{Config: cfg, NetDialer: &net.Dialer{Timeout: 10 * time.Second}}
	conn, err := d.Dial("tcp", addr)
	if err != nil {
		return nil, err
	}
	c := &RawConn{
		conn:       conn,
		bw:         bufio.NewWriterSize(conn, 64<<10),
		connWindow: 65535, // HTTP/2's initial windows, until the server says more
		initWindow: 65535,
		maxStreams: ^uint32(0),
		streams:    map[uint32]*RawStream{},
		done:       make(chan struct{}),
	}
	c.cond = sync.NewCond(&c.mu)
	c.fr = http2.NewFramer(c.bw, bufio.NewReaderSize(conn, 64<<10))
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.fr.MaxHeaderListSize = 1 << 20
	c.enc = hpack.NewEncoder(&c.hb)
	c.wmu.Lock()
	_, err = c.bw.WriteString(http2.ClientPreface)
	if err == nil {
		// Let the server send as much as it likes: this peer reads all.
		err = c.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30})
	}
	if err == nil {
		err = c.fr.WriteWindowUpdate(0, 1<<30)
	}
	if err == nil {
		err = c.bw.Flush()
	}
	c.wmu.Unlock()
	if err != nil {
		conn.Close()
		return nil, err
	}
	go c.read()
	return c, nil
}

// Close closes the connection; its streams end.
func (c *RawConn) Close() {
	c.conn.Close()
	<-c.done
}

// Open starts a stream of method (e.g. "/kcp.tunnel.v1.DialService/Dial"):
// HEADERS only, no data.
func (c *RawConn) Open(method string) (*RawStream, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return nil, c.err
	}
	c.ids++
	id := 2*c.ids - 1
	s := &RawStream{c: c, id: id, window: c.initWindow, ended: make(chan struct{})}
	c.streams[id] = s
	c.mu.Unlock()
	c.hb.Reset()
	for _, f := range [][2]string{
		{":method", "POST"}, {":scheme", "https"}, {":path", method}, {":authority", "broker"},
		{"content-type", "application/grpc"}, {"te", "trailers"},
	} {
		_ = c.enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	err := c.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: c.hb.Bytes(), EndHeaders: true})
	if err == nil {
		err = c.bw.Flush()
	}
	return s, err
}

// MaxConcurrentStreams is what the server's SETTINGS allow (unlimited until
// it says).
func (c *RawConn) MaxConcurrentStreams() uint32 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.maxStreams
}

// GRPCMessage frames payload as one gRPC message: a 5-byte prefix (not
// compressed, length) and the payload.
func GRPCMessage(payload []byte) []byte {
	return append(GRPCPrefix(len(payload)), payload...)
}

// GRPCPrefix is the prefix of a gRPC message of n bytes: what a peer sends
// to announce a message, whether or not it sends the rest.
func GRPCPrefix(n int) []byte {
	b := make([]byte, 5)
	binary.BigEndian.PutUint32(b[1:], uint32(n))
	return b
}

// Write sends p as DATA frames of at most frameSize bytes, as HTTP/2's flow
// control allows. It returns early with an error if the stream ends or ctx
// does.
func (s *RawStream) Write(ctx context.Context, p []byte, frameSize int) error {
	c := s.c
	stop := context.AfterFunc(ctx, func() { c.mu.Lock(); c.cond.Broadcast(); c.mu.Unlock() })
	defer stop()
	for len(p) > 0 {
		c.mu.Lock()
		for c.err == nil && !isDone(s.ended) && ctx.Err() == nil && (c.connWindow <= 0 || s.window <= 0) {
			c.cond.Wait()
		}
		switch {
		case c.err != nil:
			c.mu.Unlock()
			return c.err
		case isDone(s.ended):
			c.mu.Unlock()
			return fmt.Errorf("stream ended: %v", s.status.Err())
		case ctx.Err() != nil:
			c.mu.Unlock()
			return ctx.Err()
		}
		// Take what the windows allow now, and send it in frameSize
		// frames with one flush.
		n, cost := c.fits(p, frameSize, min(c.connWindow, s.window))
		if n == 0 {
			// Not even a byte of data fits with its padding: wait for
			// more window.
			c.cond.Wait()
			c.mu.Unlock()
			continue
		}
		c.connWindow -= cost
		s.window -= cost
		c.mu.Unlock()
		c.wmu.Lock()
		var err error
		for chunk := p[:n]; len(chunk) > 0 && err == nil; {
			m := min(len(chunk), c.frameData(frameSize))
			if c.Padding > 0 {
				err = c.fr.WriteDataPadded(s.id, false, chunk[:m], make([]byte, c.Padding))
			} else {
				err = c.fr.WriteData(s.id, false, chunk[:m])
			}
			chunk = chunk[m:]
		}
		if err == nil {
			err = c.bw.Flush()
		}
		c.wmu.Unlock()
		if err != nil {
			return err
		}
		c.mu.Lock()
		s.sent += int64(n)
		c.mu.Unlock()
		p = p[n:]
	}
	return nil
}

// frameData is the most data a DATA frame carries: frameSize, less the
// padding and its length if that would not fit HTTP/2's frame size.
func (c *RawConn) frameData(frameSize int) int {
	overhead := 0
	if c.Padding > 0 {
		overhead = 1 + int(c.Padding)
	}
	return max(1, min(frameSize, http2MaxFrame-overhead))
}

// fits says how much of p goes out in frames of frameSize bytes of data
// within window bytes of flow control, and what that costs of the window
// (padding included).
func (c *RawConn) fits(p []byte, frameSize int, window int64) (n int, cost int64) {
	if c.Padding == 0 {
		n := min(int64(len(p)), max(window, 0))
		return int(n), n
	}
	overhead := 1 + int64(c.Padding)
	per := c.frameData(frameSize)
	for n < len(p) {
		m := min(len(p)-n, per)
		if left := window - cost - overhead; int64(m) > left {
			m = int(max(left, 0))
		}
		if m == 0 {
			break
		}
		n += m
		cost += int64(m) + overhead
	}
	return n, cost
}

// Sent is how many bytes of data the stream has written to the connection
// so far.
func (s *RawStream) Sent() int64 {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return s.sent
}

// http2MaxFrame is the largest DATA payload a server takes unless it says
// otherwise (SETTINGS_MAX_FRAME_SIZE), and gRPC's servers do not.
const http2MaxFrame = 16384

// CloseSend half-closes the stream: an empty DATA frame with END_STREAM.
func (s *RawStream) CloseSend() error {
	c := s.c
	c.wmu.Lock()
	defer c.wmu.Unlock()
	err := c.fr.WriteData(s.id, true, nil)
	if err == nil {
		err = c.bw.Flush()
	}
	return err
}

// Reset cancels the stream (RST_STREAM CANCEL), as a gRPC client that gives
// up does.
func (s *RawStream) Reset() error {
	c := s.c
	c.wmu.Lock()
	defer c.wmu.Unlock()
	err := c.fr.WriteRSTStream(s.id, http2.ErrCodeCancel)
	if err == nil {
		err = c.bw.Flush()
	}
	return err
}

// Ended is closed once the server has ended the stream (trailers or
// RST_STREAM) or the connection is gone.
func (s *RawStream) Ended() <-chan struct{} { return s.ended }

// Status is how the stream ended: the grpc-status and grpc-message of the
// server's trailers, Unavailable for RST_STREAM or a lost connection. Call
// it once Ended is closed.
func (s *RawStream) Status() *status.Status { return s.status }

// Wait waits until the stream ends or ctx does, and returns its status.
func (s *RawStream) Wait(ctx context.Context) (*status.Status, error) {
	select {
	case <-s.ended:
		return s.status, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Received is what the server sent on the stream so far, gRPC prefixes and
// all.
func (s *RawStream) Received() []byte {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return bytes.Clone(s.data.Bytes())
}

func (c *RawConn) read() {
	defer close(c.done)
	err := c.readFrames()
	c.mu.Lock()
	c.err = fmt.Errorf("connection lost: %w", err)
	for _, s := range c.streams {
		s.end(status.New(codes.Unavailable, c.err.Error()))
	}
	c.streams = nil
	c.cond.Broadcast()
	c.mu.Unlock()
	c.conn.Close()
}

// readFrames reads the server's frames until the connection fails or the
// server sends a GOAWAY with an error, and returns why it stopped.
func (c *RawConn) readFrames() error {
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			return err
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			c.onSettings(f)
		case *http2.PingFrame:
			if !f.IsAck() {
				c.write(func() error { return c.fr.WritePing(true, f.Data) })
			}
		case *http2.WindowUpdateFrame:
			c.onWindowUpdate(f)
		case *http2.DataFrame:
			c.onData(f)
		case *http2.MetaHeadersFrame:
			c.onHeaders(f)
		case *http2.RSTStreamFrame:
			c.endStream(f.StreamID, status.New(codes.Unavailable, "RST_STREAM "+f.ErrCode.String()))
		case *http2.GoAwayFrame:
			if f.ErrCode != http2.ErrCodeNo {
				return fmt.Errorf("GOAWAY %v: %s", f.ErrCode, f.DebugData())
			}
		}
	}
}

// onSettings applies the server's SETTINGS that matter to a writer (the
// streams' initial window, which moves every open stream's window by the
// change, and the concurrent streams allowed) and acknowledges them.
func (c *RawConn) onSettings(f *http2.SettingsFrame) {
	if f.IsAck() {
		return
	}
	c.mu.Lock()
	_ = f.ForeachSetting(func(s http2.Setting) error {
		switch s.ID {
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - c.initWindow
			c.initWindow = int64(s.Val)
			for _, st := range c.streams {
				st.window += delta
			}
		case http2.SettingMaxConcurrentStreams:
			c.maxStreams = s.Val
		}
		return nil
	})
	c.cond.Broadcast()
	c.mu.Unlock()
	c.write(func() error { return c.fr.WriteSettingsAck() })
}

// onWindowUpdate gives the connection or a stream more window, and wakes
// the writers waiting for it.
func (c *RawConn) onWindowUpdate(f *http2.WindowUpdateFrame) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if f.StreamID == 0 {
		c.connWindow += int64(f.Increment)
	} else if s := c.streams[f.StreamID]; s != nil {
		s.window += int64(f.Increment)
	}
	c.cond.Broadcast()
}

// onData keeps what the server sent on a stream and gives the window back
// at once: this peer reads everything. Data that ends the stream without
// trailers ends it as Internal, as a gRPC client would.
func (c *RawConn) onData(f *http2.DataFrame) {
	c.mu.Lock()
	if s := c.streams[f.StreamID]; s != nil {
		s.data.Write(f.Data())
	}
	c.mu.Unlock()
	if n := uint32(len(f.Data())); n > 0 {
		c.write(func() error {
			if err := c.fr.WriteWindowUpdate(0, n); err != nil {
				return err
			}
			return c.fr.WriteWindowUpdate(f.StreamID, n)
		})
	}
	if f.StreamEnded() {
		c.endStream(f.StreamID, status.New(codes.Internal, "stream ended without trailers"))
	}
}

// onHeaders ends a stream on an HTTP status other than 200, on trailers
// (with their grpc-status and grpc-message), or on headers that end it
// without a grpc-status.
func (c *RawConn) onHeaders(f *http2.MetaHeadersFrame) {
	if code := f.PseudoValue("status"); code != "" && code != "200" {
		c.endStream(f.StreamID, status.New(codes.Unknown, "HTTP status "+code))
		return
	}
	if v := field(f, "grpc-status"); v != "" {
		n, _ := strconv.Atoi(v)
		msg, _ := url.PathUnescape(field(f, "grpc-message"))
		c.endStream(f.StreamID, status.New(codes.Code(n), msg))
	} else if f.StreamEnded() {
		c.endStream(f.StreamID, status.New(codes.Internal, "stream ended without grpc-status"))
	}
}

// field is the value of header name in f, or "".
func field(f *http2.MetaHeadersFrame, name string) string {
	for _, hf := range f.RegularFields() {
		if hf.Name == name {
			return hf.Value
		}
	}
	return ""
}

func (c *RawConn) write(f func() error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if err := f(); err == nil {
		_ = c.bw.Flush()
	}
}

func (c *RawConn) endStream(id uint32, st *status.Status) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s := c.streams[id]; s != nil {
		s.end(st)
		delete(c.streams, id)
		c.cond.Broadcast()
	}
}

// end records st and closes ended; c.mu is held.
func (s *RawStream) end(st *status.Status) {
	if !isDone(s.ended) {
		s.status = st
		close(s.ended)
	}
}

func isDone(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

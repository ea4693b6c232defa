package kcpplugin

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	protocodec "google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// FuzzCallerFrames plays a broker that answers a dial with an arbitrary
// sequence of frames, and checks what the caller's conn makes of it: Read
// returns exactly the data sent before close_write, in order, and then
// io.EOF, or the status that ended the stream, or Internal for a frame that
// breaks the protocol; it never panics and never hangs. Frames are what a
// conforming broker sends (data of any length, close_write, established,
// a status) and also raw bytes, which the caller must take as the proto
// message they encode.
func FuzzCallerFrames(f *testing.F) {
	b := startScriptedBroker(f)
	f.Add([]byte{0, opData, 5, opCloseWrite})
	f.Add([]byte{0, opData, 0, opData, 1, opBigData, 1, 0, opCloseWrite, opData, 3})
	f.Add([]byte{2, opData, 200, opData, 7, opStatus, byte(codes.Unavailable)})
	f.Add([]byte{4, opData, 9, opStatus, byte(codes.Canceled)})
	f.Add([]byte{6, opData, 9, opStatus, 0})
	f.Add([]byte{0, opData, 4, opEstablished, opData, 4})
	f.Add([]byte{0, opData, 4, opEmpty})
	f.Add([]byte{1, opData, 4})                                     // data instead of established
	f.Add([]byte{1, opStatus, byte(codes.NotFound)})                // refused dial
	f.Add([]byte{1})                                                // ended without an answer
	f.Add([]byte{1, opRaw, 2, 0x0a, 0x00, opData, 3, opCloseWrite}) // established, raw
	f.Add([]byte{0, opRaw, 3, 0x12, 0x01, 'x', opRaw, 2, 0x1a, 0x00})
	f.Add([]byte{0, opRaw, 4, 0x12, 0x81, 0x00, 'x', opCloseWrite})            // overlong length
	f.Add([]byte{0, opRaw, 6, 0x12, 0x01, 'a', 0x12, 0x01, 'b', opCloseWrite}) // data twice: the last counts
	f.Add([]byte{0, opRaw, 5, 0x12, 0x01, 'a', 0x78, 0x01, opCloseWrite})      // data and an unknown field
	f.Add([]byte{0, opRaw, 5, 0x12, 0x01, 'a', 0x1a, 0x00, opData, 2})         // data, then close_write wins
	f.Add([]byte{0, opRaw, 3, 0x12, 0x05, 'a'})                                // truncated
	f.Fuzz(func(t *testing.T, in []byte) {
		s := parseScript(in)
		b.check(t, s)
	})
}

// Non-empty data in any encoding other than 0x12 varint(n) payload (data and
// an unknown field, data twice) is refused as a protocol error, as the broker
// and the agent refuse it: the reader may see the data up to that frame, or
// that data with the frame's (the alternative outcome), never bytes dropped.

// Script opcodes, taken modulo opCount from the fuzz input.
const (
	opData        = iota // next byte: length 0-255
	opBigData            // next two bytes: length 0-65535
	opCloseWrite         //
	opEstablished        // a second one
	opEmpty              // a message with no frame
	opRaw                // next byte n, then n bytes sent as the message
	opStatus             // next byte: the code the RPC ends with; ends the script
	opCount
)

// frame is one message of a script: its wire bytes, and what it decodes to.
type frame struct {
	wire []byte
	msg  *tunnelv1.DialResponse // nil if wire does not decode
	// canonical says wire is a data frame in the protocol's one encoding.
	canonical bool
}

// script is what the broker does after reading the target.
type script struct {
	skipEstablished bool // answer with the frames only
	readFrom        int  // where in readSizes the caller's Reads start
	frames          []frame
	end             codes.Code // the RPC's status after the frames
}

// Limits that keep one run cheap.
const (
	maxScriptFrames = 64
	maxScriptBytes  = 256 << 10
)

// readSizes are the sizes of the caller's Reads, in turn: every few Reads
// a tiny one, so that Reads end in the middle of frames (and of gRPC's
// buffers within a frame), and large ones, so that a run stays cheap.
var readSizes = []int{1, 64 << 10, 3, 1000, 32<<10 + 5, 64, 4096}

// parseScript reads a script from fuzz input: a flags byte, then opcodes
// and their arguments until the input, the frame limit or a status ends it.
func parseScript(in []byte) script {
	p := &scriptParser{in: in}
	flags, _ := p.next()
	p.s.skipEstablished = flags&1 != 0
	p.s.readFrom = int(flags>>1) % len(readSizes)
	for len(p.s.frames) < maxScriptFrames {
		op, ok := p.next()
		if !ok || p.apply(op) {
			break
		}
	}
	return p.s
}

// scriptParser is parseScript's state: the input not read yet, the script
// so far and how many data bytes it holds, which maxScriptBytes bounds.
type scriptParser struct {
	in    []byte
	s     script
	total int
}

// next takes the input's next byte; past its end, it is 0 and false, so
// that an opcode missing its arguments still makes a frame.
func (p *scriptParser) next() (byte, bool) {
	if len(p.in) == 0 {
		return 0, false
	}
	b := p.in[0]
	p.in = p.in[1:]
	return b, true
}

// apply reads op's arguments and adds its frame, or, for opStatus, the
// RPC's end; it says whether the script has ended.
func (p *scriptParser) apply(op byte) (ended bool) {
	switch op % opCount {
	case opData:
		n, _ := p.next()
		p.data(int(n))
	case opBigData:
		hi, _ := p.next()
		lo, _ := p.next()
		p.data(int(hi)<<8 | int(lo))
	case opCloseWrite:
		p.add(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_CloseWrite{CloseWrite: &tunnelv1.CloseWrite{}}})
	case opEstablished:
		p.add(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Established{Established: &tunnelv1.Established{TunnelId: "again"}}})
	case opEmpty:
		p.add(&tunnelv1.DialResponse{})
	case opRaw:
		n, _ := p.next()
		p.raw(int(n))
	case opStatus:
		c, _ := p.next()
		p.s.end = codes.Code(c % 17)
		return true
	}
	return false
}

// add appends m as the protocol encodes it.
func (p *scriptParser) add(m *tunnelv1.DialResponse) {
	wire, err := proto.Marshal(m)
	if err != nil {
		panic(err)
	}
	p.s.frames = append(p.s.frames, frame{wire: wire, msg: m, canonical: true})
}

// data appends a data frame of n bytes, fewer if the script would hold
// more than maxScriptBytes.
func (p *scriptParser) data(n int) {
	n = min(n, maxScriptBytes-p.total)
	p.total += n
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(len(p.s.frames)*31 + i) // each frame its own pattern
	}
	p.add(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Data{Data: b}})
}

// raw appends the input's next n bytes (fewer where it ends) as a message
// of their own, with what they decode to if they decode.
func (p *scriptParser) raw(n int) {
	wire := append([]byte(nil), p.in[:min(n, len(p.in))]...)
	p.in = p.in[len(wire):]
	fr := frame{wire: wire}
	var m tunnelv1.DialResponse
	if proto.Unmarshal(wire, &m) == nil {
		fr.msg = &m
		fr.canonical = isDataFrame(wire)
	}
	p.s.frames = append(p.s.frames, fr)
}

// isDataFrame says wire is a data frame as docs/protocol.md §2 spells it:
// 0x12 varint(n) payload, one field and nothing else.
func isDataFrame(wire []byte) bool {
	num, typ, n := protowire.ConsumeTag(wire)
	if n < 0 || num != 2 || typ != protowire.BytesType {
		return false
	}
	m := protowire.ConsumeFieldValue(num, typ, wire[n:])
	return m >= 0 && n+m == len(wire)
}

// outcome is what the caller should see.
type outcome struct {
	dialErr codes.Code // OK if the dial succeeds
	data    []byte     // what Read returns, in all
	end     error      // what Read returns after it: io.EOF, net.ErrClosed or a status
	// A frame that encodes data other than canonically may also be
	// refused as a protocol error: alternatives lists what the caller
	// may have read before such a refusal.
	alternatives [][]byte
}

// expect works out the outcome of s from the protocol (docs/protocol.md §2,
// §4, §5) and kcpplugin's documented choices: empty data is ignored, a
// status Canceled reads as net.ErrClosed, an OK end without close_write as
// io.EOF.
func expect(s script) outcome {
	frames := s.frames
	if s.skipEstablished {
		if len(frames) == 0 {
			if s.end == codes.OK {
				return outcome{dialErr: codes.Internal}
			}
			return outcome{dialErr: s.end}
		}
		if frames[0].msg == nil {
			return outcome{dialErr: codes.Internal}
		}
		if frames[0].msg.GetEstablished() == nil {
			return outcome{dialErr: codes.Internal}
		}
		frames = frames[1:]
	}
	var o outcome
	for _, f := range frames {
		if f.msg == nil {
			o.end = status.Error(codes.Internal, "undecodable frame")
			return o
		}
		switch fr := f.msg.GetFrame().(type) {
		case *tunnelv1.DialResponse_Data:
			if !f.canonical && len(fr.Data) > 0 {
				o.alternatives = append(o.alternatives, bytes.Clone(o.data))
			}
			o.data = append(o.data, fr.Data...)
		case *tunnelv1.DialResponse_CloseWrite:
			o.end = io.EOF
			return o
		default:
			o.end = status.Error(codes.Internal, "protocol error")
			return o
		}
	}
	switch s.end {
	case codes.OK:
		o.end = io.EOF
	case codes.Canceled:
		o.end = net.ErrClosed
	default:
		o.end = status.Error(s.end, "")
	}
	return o
}

// scriptedBroker runs scripts: each dial names its script by namespace.
type scriptedBroker struct {
	dialer  *Dialer
	seq     atomic.Int64
	scripts sync.Map // namespace -> script
}

func (b *scriptedBroker) handle(stream tunnelv1.DialService_DialServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	v, ok := b.scripts.Load(first.GetTarget().GetNamespace())
	if !ok {
		return status.Error(codes.FailedPrecondition, "no script")
	}
	s := v.(script)
	if !s.skipEstablished {
		if err := stream.Send(&tunnelv1.DialResponse{Frame: &tunnelv1.DialResponse_Established{Established: &tunnelv1.Established{TunnelId: "fuzz"}}}); err != nil {
			return err
		}
	}
	for _, f := range s.frames {
		raw := rawMessage(f.wire)
		if err := stream.SendMsg(&raw); err != nil {
			return err
		}
	}
	if s.end == codes.OK {
		return nil
	}
	return status.Error(s.end, "scripted end")
}

// check runs s against the caller and compares with expect(s).
func (b *scriptedBroker) check(t *testing.T, s script) {
	ns := "n" + strconv.FormatInt(b.seq.Add(1), 10)
	b.scripts.Store(ns, s)
	defer b.scripts.Delete(ns)
	want := expect(s)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := b.dialer.DialService(ctx, testCluster, ns, testService, testPort)
	if want.dialErr != codes.OK {
		if c != nil {
			c.Close()
		}
		if status.Code(err) != want.dialErr {
			t.Fatalf("dial: %v, want %v", err, want.dialErr)
		}
		return
	}
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var got []byte
	buf := make([]byte, slices.Max(readSizes))
	for i := s.readFrom; ; i++ {
		n, err := c.Read(buf[:readSizes[i%len(readSizes)]])
		got = append(got, buf[:n]...)
		if err == nil {
			if n == 0 {
				t.Fatal("Read returned 0 bytes and no error")
			}
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("Read hangs after %d bytes; want %d bytes and then %v", len(got), len(want.data), want.end)
		}
		if n != 0 {
			t.Fatalf("Read returned %d bytes with %v", n, err)
		}
		for _, alt := range want.alternatives {
			if bytes.Equal(got, alt) && status.Code(err) == codes.Internal {
				return // refused a non-canonical data frame
			}
		}
		if !bytes.Equal(got, want.data) {
			t.Fatalf("read %d bytes %s, want %d bytes %s (then %v)", len(got), short(got), len(want.data), short(want.data), err)
		}
		if !sameEnd(err, want.end) {
			t.Fatalf("after the data Read returned %v, want %v", err, want.end)
		}
		// It stays that way.
		if _, again := c.Read(buf); !sameEnd(again, want.end) {
			t.Fatalf("second Read at the end returned %v, want %v", again, want.end)
		}
		return
	}
}

func sameEnd(err, want error) bool {
	switch {
	case want == io.EOF:
		return err == io.EOF // exactly: io.ReadAll and friends compare
	case errors.Is(want, net.ErrClosed):
		return errors.Is(err, net.ErrClosed)
	default:
		return status.Code(err) == status.Code(want)
	}
}

func short(b []byte) string {
	if len(b) > 16 {
		return fmt.Sprintf("%x...", b[:16])
	}
	return fmt.Sprintf("%x", b)
}

// startScriptedBroker serves scripts on loopback for the whole fuzz run, so
// that one input costs one Dial RPC.
func startScriptedBroker(tb testing.TB) *scriptedBroker {
	b := &scriptedBroker{}
	b.dialer = serveFakeBroker(tb, b.handle, grpc.ForceServerCodecV2(rawCodec{encoding.GetCodecV2(protocodec.Name)}))
	// A dial that fails fails DialService (early_test.go has the failures
	// of a dial with early data).
	b.dialer.EarlyData = false
	return b
}

// rawMessage is a message already in its wire encoding.
type rawMessage []byte

// rawCodec sends rawMessages as they are, and everything else as proto.
type rawCodec struct{ proto encoding.CodecV2 }

func (c rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	if r, ok := v.(*rawMessage); ok {
		return mem.BufferSlice{mem.SliceBuffer(*r)}, nil
	}
	return c.proto.Marshal(v)
}

func (c rawCodec) Unmarshal(data mem.BufferSlice, v any) error { return c.proto.Unmarshal(data, v) }

func (c rawCodec) Name() string { return protocodec.Name }

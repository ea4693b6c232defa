package wire

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protodelim"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// DataProtocol is the ALPN protocol of a data connection
// (docs/protocol.md §3.5): an agent's TLS connection to the broker's gRPC
// port that carries its leg of one tunnel after another without gRPC
// (§3.7). The broker offers it beside gRPC's "h2" on the same port and
// with the same mTLS.
const DataProtocol = "kcp-tunnel-data/1"

// The bounds of a data connection's two messages, in bytes, without their
// length prefix. An open is a dial id (at most 13 bytes); a result's
// message is cut to fit.
const (
	maxOpen       = 32
	maxOpenResult = 512
)

// WriteOpen starts a tunnel on a data connection: the length-delimited
// TunnelRequest{open{dial_id}}. The tunnel's bytes MAY follow at once.
func WriteOpen(w io.Writer, dialID uint64) error {
	return writeDelimited(w, &tunnelv1.TunnelRequest{Frame: &tunnelv1.TunnelRequest_Open{Open: &tunnelv1.TunnelOpen{DialId: dialID}}})
}

// ReadOpen reads an open, and not a byte past it: what follows is the
// tunnel's. Anything but an open is an InvalidArgument status; a
// connection that ends first, the read's error: io.EOF if it ended before
// the open's first byte, io.ErrUnexpectedEOF inside it.
func ReadOpen(r io.Reader) (dialID uint64, err error) {
	var req tunnelv1.TunnelRequest
	if err := read(r, &req, maxOpen); err != nil {
		return 0, err
	}
	if req.GetOpen() == nil {
		return 0, status.Error(codes.InvalidArgument, "protocol error: a data connection must start with open")
	}
	return req.GetOpen().GetDialId(), nil
}

// WriteOpenResult answers an open with err's status: nil is OK, and the
// tunnel's bytes follow.
func WriteOpenResult(w io.Writer, err error) error {
	return writeResult(w, &tunnelv1.OpenResult{}, err)
}

// writeResult writes res with err's status (resultOf).
func writeResult(w io.Writer, res *tunnelv1.OpenResult, err error) error {
	return writeDelimited(w, resultOf(res, err))
}

// resultOf is res with err's status: its code, and its message cut to fit
// the bound a reader applies.
func resultOf(res *tunnelv1.OpenResult, err error) *tunnelv1.OpenResult {
	st := status.Convert(err)
	msg := st.Message()
	if room := maxOpenResult - 16 - len(res.GetTunnelId()); len(msg) > room {
		msg = msg[:room]
	}
	res.Code, res.Message = int32(st.Code()), msg
	return res
}

// writeDelimited writes m length-delimited with one Write: one TLS record,
// where protodelim.MarshalTo would make two.
func writeDelimited(w io.Writer, m proto.Message) error {
	buf, err := appendDelimited(nil, m)
	if err != nil {
		return err
	}
	_, err = w.Write(buf)
	return err
}

// appendDelimited appends m to buf, after its length as a varint.
func appendDelimited(buf []byte, m proto.Message) ([]byte, error) {
	size := proto.Size(m)
	buf = slices.Grow(buf, size+binary.MaxVarintLen64)
	buf = protowire.AppendVarint(buf, uint64(size))
	return proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(buf, m)
}

// WriteAccepted tells the agent of a new data connection that the broker
// replica brokerID took it as a spare.
func WriteAccepted(w io.Writer, brokerID string) error {
	return writeDelimited(w, &tunnelv1.OpenResult{BrokerId: brokerID})
}

// ReadAccepted reads the broker's first answer on a new data connection:
// the replica that took it as a spare, or its refusal as a status error.
func ReadAccepted(r io.Reader) (brokerID string, err error) {
	res, err := readResult(r, "a data connection")
	return res.GetBrokerId(), err
}

// AwaitAccepted is ReadAccepted on conn, a new data or dial connection over
// sock, for as long as ctx lasts: its deadline bounds the wait, and its
// cancellation (the pool's close) ends it at once, as a read deadline alone
// would not. A wait that ctx ended is ctx's error, and leaves sock's read
// deadline in the past: close the connection.
func AwaitAccepted(ctx context.Context, conn io.Reader, sock *Socket) (brokerID string, err error) {
	stop := context.AfterFunc(ctx, func() { _ = sock.SetReadDeadline(time.Now()) })
	brokerID, err = ReadAccepted(conn)
	if !stop() {
		return "", fmt.Errorf("waiting for the broker to accept the connection: %w", ctx.Err())
	}
	return brokerID, err
}

// ReadOpenResult reads the broker's answer to an open, and not a byte past
// it: nil for OK, else the refusal as a status error. A connection that
// ends first, or an answer that is not one, is an error of its own.
func ReadOpenResult(r io.Reader) error {
	_, err := readResult(r, "open")
	return err
}

// readResult reads one OpenResult, the answer to what: a refusal is its
// status error, and nil is returned with it. An answer that is too large
// or does not decode is the broker's mistake, so it is Internal here, not
// the InvalidArgument that read gives a peer's malformed message.
func readResult(r io.Reader, what string) (*tunnelv1.OpenResult, error) {
	var res tunnelv1.OpenResult
	if err := read(r, &res, maxOpenResult); err != nil {
		if st, ok := status.FromError(err); ok {
			return nil, status.Errorf(codes.Internal, "the broker's answer to %s: %s", what, st.Message())
		}
		return nil, fmt.Errorf("reading the broker's answer to %s: %w", what, err)
	}
	if res.GetCode() != int32(codes.OK) {
		return nil, status.Error(codes.Code(res.GetCode()), res.GetMessage())
	}
	return &res, nil
}

// read reads one length-delimited message of at most limit bytes. The
// length is read a byte at a time, so nothing after the message is read:
// crypto/tls keeps the rest of a record for the next Read. The
// connection's errors are returned as they are; a message that is too
// large or does not decode is an InvalidArgument status.
func read(r io.Reader, m proto.Message, limit int64) error {
	br := &byteReader{r: r}
	err := protodelim.UnmarshalOptions{MaxSize: limit}.UnmarshalFrom(br, m)
	var tooBig *protodelim.SizeTooLargeError
	switch {
	case err == nil:
		return nil
	case br.err != nil:
		return br.err
	case errors.As(err, &tooBig):
		return status.Errorf(codes.InvalidArgument, "protocol error: a %d-byte message where at most %d may be", tooBig.Size, limit)
	}
	return status.Errorf(codes.InvalidArgument, "protocol error: %v", err)
}

// byteReader gives protodelim the byte reads it needs for the length, and
// keeps the connection's first error.
type byteReader struct {
	r    io.Reader
	read int
	err  error
}

func (b *byteReader) ReadByte() (byte, error) {
	var p [1]byte
	if _, err := io.ReadFull(b, p[:]); err != nil {
		return 0, err
	}
	return p[0], nil
}

func (b *byteReader) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	b.read += n
	if err != nil && b.err == nil {
		b.err = err
		if err == io.EOF && b.read > 0 {
			// The connection ended inside the message.
			b.err = io.ErrUnexpectedEOF
		}
	}
	return n, err
}

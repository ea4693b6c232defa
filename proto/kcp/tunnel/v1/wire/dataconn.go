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

// The bounds of a data connection's messages, in bytes, without their
// length prefix. A bind is a session id (12 hex digits today); an order a
// dial's: its target, its early data
// and the rest, as a dial connection's dial; a result's message is cut to
// fit.
const (
	maxBind       = 128
	maxOrder      = maxDial
	maxOpenResult = 512
)

// WriteBind binds a new data connection to the session of the agent's
// control stream on this replica (docs/protocol.md §3.5): its first
// message, the length-delimited DataBind, before the broker's acceptance.
func WriteBind(w io.Writer, sessionID string) error {
	return writeDelimited(w, &tunnelv1.DataBind{SessionId: sessionID})
}

// ReadBind reads a data connection's bind, and not a byte past it. A
// message that is not one is an InvalidArgument status; a connection that
// ends first, the read's error.
func ReadBind(r io.Reader) (sessionID string, err error) {
	var bind tunnelv1.DataBind
	if err := read(r, &bind, maxBind); err != nil {
		return "", err
	}
	if bind.GetSessionId() == "" {
		return "", status.Error(codes.InvalidArgument, "protocol error: a data connection must start with the session it binds to")
	}
	return bind.GetSessionId(), nil
}

// WriteOrder sends a dial order on an idle data connection, in one Write:
// the length-delimited DialOrder, with the caller's early data.
func WriteOrder(w io.Writer, order *tunnelv1.DialOrder) error {
	return writeDelimited(w, order)
}

// ReadOrder reads the broker's next message on an idle data connection, a
// dial order, and not a byte past it. One that is too large or does not
// decode is the broker's mistake: Internal, as a malformed answer is.
func ReadOrder(r io.Reader) (*tunnelv1.DialOrder, error) {
	var order tunnelv1.DialOrder
	if err := read(r, &order, maxOrder); err != nil {
		if st, ok := status.FromError(err); ok {
			return nil, status.Errorf(codes.Internal, "the broker's dial order: %s", st.Message())
		}
		return nil, err
	}
	return &order, nil
}

// WriteAnswer is the agent's answer to a dial order on a data connection:
// OK (err nil) once it has connected to the target, and the tunnel's
// frames follow; else err's status, the dial's failure, and the connection
// is idle again.
func WriteAnswer(w io.Writer, err error) error {
	return writeResult(w, &tunnelv1.OpenResult{}, err)
}

// ReadAnswer reads the agent's answer to a dial order, and not a byte past
// it: nil for OK, else the dial's failure as a status error. An answer
// that is too large or does not decode is the agent's protocol error, an
// InvalidArgument status that wraps ErrBadAnswer; a connection that ends
// first is the read's error.
func ReadAnswer(r io.Reader) error {
	var res tunnelv1.OpenResult
	if err := read(r, &res, maxOpenResult); err != nil {
		if _, ok := status.FromError(err); ok {
			return fmt.Errorf("%w: %w", ErrBadAnswer, err)
		}
		return err
	}
	if res.GetCode() != int32(codes.OK) {
		return status.Error(codes.Code(res.GetCode()), res.GetMessage())
	}
	return nil
}

// ErrBadAnswer is an agent's answer to a dial order that is not one.
var ErrBadAnswer = errors.New("protocol error: not an answer to the dial order")

// WriteOpenResult is the broker's refusal of a data or dial connection,
// or of its bind or dial, with err's status.
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

package wire

import (
	"io"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// DialProtocol is the ALPN protocol of a dial connection (docs/protocol.md
// §3.6): a caller's TLS connection to the broker's gRPC port that carries
// the caller's leg of one tunnel after another without gRPC (§3.7), as a
// data connection carries the agent's. The broker offers it beside "h2"
// and DataProtocol, on the same port and with the same mTLS.
const DialProtocol = "kcp-tunnel-dial/1"

// maxDial bounds a dial's message without its length prefix: its early
// data, and a target of valid names with room to spare.
const maxDial = MaxEarlyData + 1<<10

// AppendDial appends a dial to buf: the length-delimited
// DialRequest{target, early_data}, which the caller sends once the broker
// has taken the connection (ReadAccepted). The tunnel's bytes MAY follow at
// once, in data frames (§3.7). Written with one Write, the dial and its
// early data leave in one TLS record, a ClientHello included.
func AppendDial(buf []byte, target *tunnelv1.Target, earlyData []byte) ([]byte, error) {
	req := &tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: target}, EarlyData: earlyData}
	size := proto.Size(req)
	if size > maxDial {
		return buf, status.Errorf(codes.InvalidArgument, "a dial may be at most %d bytes, not %d", maxDial, size)
	}
	buf = protowire.AppendVarint(buf, uint64(size))
	return proto.MarshalOptions{UseCachedSize: true}.MarshalAppend(buf, req)
}

// ReadDial reads a dial, and not a byte past it: what follows is the
// tunnel's frames. A message that is not a dial (a target, and no data frame) is
// an InvalidArgument status; the target and the early data are the
// caller's to validate. A connection that ends first is the read's error:
// io.EOF if it ended before the dial's first byte.
func ReadDial(r io.Reader) (*tunnelv1.DialRequest, error) {
	var req tunnelv1.DialRequest
	if err := read(r, &req, maxDial); err != nil {
		return nil, err
	}
	if req.GetTarget() == nil {
		return nil, status.Error(codes.InvalidArgument, "protocol error: a dial connection's first message must name a target")
	}
	return &req, nil
}

// WriteDialResult answers a dial: OK (err nil) with the tunnel's id, and
// the tunnel's frames follow; or err's status, and the broker closes the
// connection.
func WriteDialResult(w io.Writer, tunnelID string, err error) error {
	return writeResult(w, &tunnelv1.OpenResult{TunnelId: tunnelID}, err)
}

// ReadDialResult reads the broker's answer to a dial, and not a byte past
// it: the tunnel's id, or the dial's failure as a status error. A
// connection that ends first, or an answer that is not one, is an error of
// its own.
func ReadDialResult(r io.Reader) (tunnelID string, err error) {
	res, err := readResult(r, "the dial")
	return res.GetTunnelId(), err
}

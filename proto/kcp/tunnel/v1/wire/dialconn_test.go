package wire

import (
	"bytes"
	"io"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protodelim"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

var dialTarget = &tunnelv1.Target{Cluster: "root:org:ws", Namespace: "default", Service: "webhook", Port: 443}

func TestDialIsReadWithItsEarlyDataAndNotTheBytesThatFollowIt(t *testing.T) {
	buf, err := AppendDial([]byte("kept"), dialTarget, []byte("ClientHello"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(buf, []byte("kept")) {
		t.Fatalf("AppendDial did not append: %q", buf)
	}
	conn := bytes.NewBuffer(append(buf[len("kept"):], "rest"...))
	req, err := ReadDial(oneByteReader{conn})
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(req.GetTarget(), dialTarget) || string(req.GetEarlyData()) != "ClientHello" {
		t.Fatalf("ReadDial = %v", req)
	}
	if conn.String() != "rest" {
		t.Fatalf("after the dial the connection holds %q, want the tunnel's bytes", conn.String())
	}
}

func TestDialWithTooMuchEarlyDataIsRefusedByBothSides(t *testing.T) {
	if _, err := AppendDial(nil, dialTarget, make([]byte, maxDial)); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("AppendDial of %d bytes = %v, want InvalidArgument", maxDial, err)
	}
	var conn bytes.Buffer
	big := &tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Target{Target: dialTarget}, EarlyData: make([]byte, maxDial)}
	if _, err := protodelim.MarshalTo(&conn, big); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadDial(&conn); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("ReadDial of a too large dial = %v, want InvalidArgument", err)
	}
}

func TestDialThatNamesNoTargetIsAProtocolError(t *testing.T) {
	var conn bytes.Buffer
	if _, err := protodelim.MarshalTo(&conn, &tunnelv1.DialRequest{Frame: &tunnelv1.DialRequest_Data{Data: []byte("x")}}); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadDial(&conn); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("ReadDial of a data frame = %v, want InvalidArgument", err)
	}
}

func TestDialConnectionEndingBeforeItsDialIsEOF(t *testing.T) {
	if _, err := ReadDial(&bytes.Buffer{}); err != io.EOF {
		t.Fatalf("ReadDial of nothing = %v, want io.EOF", err)
	}
	buf, _ := AppendDial(nil, dialTarget, nil)
	if _, err := ReadDial(bytes.NewReader(buf[:len(buf)-1])); err != io.ErrUnexpectedEOF {
		t.Fatalf("ReadDial of a cut dial = %v, want io.ErrUnexpectedEOF", err)
	}
}

func TestDialResultsCarryTheTunnelOrTheFailure(t *testing.T) {
	var conn bytes.Buffer
	if err := WriteDialResult(&conn, "00ff", nil); err != nil {
		t.Fatal(err)
	}
	if err := WriteDialResult(&conn, "", status.Error(codes.PermissionDenied, "may not dial root:other")); err != nil {
		t.Fatal(err)
	}
	if id, err := ReadDialResult(&conn); id != "00ff" || err != nil {
		t.Fatalf("first answer = %q, %v, want the tunnel", id, err)
	}
	_, err := ReadDialResult(&conn)
	if st := status.Convert(err); st.Code() != codes.PermissionDenied || st.Message() != "may not dial root:other" {
		t.Fatalf("second answer = %v, want the refusal", err)
	}
}

func TestOneMessageIsOneWrite(t *testing.T) {
	var w countingWriter
	if err := WriteDialResult(&w, "00ff", nil); err != nil {
		t.Fatal(err)
	}
	if err := WriteOrder(&w, &tunnelv1.DialOrder{DialId: 7, EarlyData: make([]byte, MaxEarlyData)}); err != nil {
		t.Fatal(err)
	}
	if err := WriteBind(&w, "4a1c0ffee000"); err != nil {
		t.Fatal(err)
	}
	if w.writes != 3 {
		t.Fatalf("three messages took %d writes, want one each (one TLS record)", w.writes)
	}
}

// countingWriter keeps what is written, and counts the Writes.
type countingWriter struct {
	bytes.Buffer
	writes int
}

func (w *countingWriter) Write(p []byte) (int, error) {
	w.writes++
	return w.Buffer.Write(p)
}

func TestAMalformedAnswerIsTheBrokersMistake(t *testing.T) {
	for name, answer := range map[string][]byte{
		"too large":       append(protowire.AppendVarint(nil, maxOpenResult+1), make([]byte, maxOpenResult+1)...),
		"does not decode": {3, 0xff, 0xff, 0xff},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := ReadDialResult(bytes.NewReader(answer))
			if status.Code(err) != codes.Internal {
				t.Fatalf("ReadDialResult = %v, want Internal", err)
			}
			if _, err := ReadAccepted(bytes.NewReader(answer)); status.Code(err) != codes.Internal {
				t.Fatalf("ReadAccepted = %v, want Internal", err)
			}
		})
	}
}

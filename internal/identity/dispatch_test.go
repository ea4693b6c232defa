package identity

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kcp-dev/tunnel-broker/internal/devca"
)

const testProtocol = "test-data/1"

// dispatched is what a Dispatch handler was given.
type dispatched struct {
	conn net.Conn
	peer AuthInfo
}

func TestDispatchHandsItsProtocolsConnectionsOverAndGRPCKeepsTheRest(t *testing.T) {
	ca := newCA(t, "ca")
	server := newSource(t, ca, devca.Leaf{SPIFFEID: "/broker"})
	client := newSource(t, ca, devca.Leaf{SPIFFEID: "/agent"})
	got := make(chan dispatched, 1)
	creds := Dispatch(ServerCredentials(server, tlsconfig.AuthorizeAny(), Protocols(testProtocol)),
		map[string]func(net.Conn, AuthInfo){testProtocol: func(conn net.Conn, peer AuthInfo) { got <- dispatched{conn, peer} }})
	srv := grpc.NewServer(grpc.Creds(creds))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	defer srv.Stop()

	// gRPC, on the same port, still works.
	cc, err := grpc.NewClient("passthrough:///"+lis.Addr().String(),
		grpc.WithTransportCredentials(ClientCredentials(client, tlsconfig.AuthorizeAny())))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), waitLong)
	defer cancel()
	if _, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("gRPC beside the dispatched protocol: %v", err)
	}

	// A client that asks for the protocol reaches the handler, verified.
	raw, err := net.Dial("tcp", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	dataCreds := ClientCredentials(client, tlsconfig.AuthorizeAny(), Protocols(testProtocol))
	conn, info, err := dataCreds.ClientHandshake(ctx, lis.Addr().String(), raw)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if p := info.(AuthInfo).State.NegotiatedProtocol; p != testProtocol {
		t.Fatalf("negotiated %q, want %q", p, testProtocol)
	}
	d := <-got
	defer d.conn.Close()
	if d.peer.ID.Path() != "/agent" {
		t.Fatalf("the handler was given peer %q", d.peer.ID)
	}

	halfCloseBothWays(t, conn, d.conn)
}

// halfCloseBothWays checks that client and server are TLS connections that
// half-close with a close_notify, each way in turn.
func halfCloseBothWays(t *testing.T, conn, server net.Conn) {
	t.Helper()
	if _, err := conn.Write([]byte("up")); err != nil {
		t.Fatal(err)
	}
	if err := conn.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatalf("the client's CloseWrite: %v", err)
	}
	up, err := io.ReadAll(server)
	if err != nil || string(up) != "up" {
		t.Fatalf("the handler read %q, %v; want up and EOF", up, err)
	}
	if _, err := server.Write([]byte("down")); err != nil {
		t.Fatalf("writing after the peer's half-close: %v", err)
	}
	if err := server.(interface{ CloseWrite() error }).CloseWrite(); err != nil {
		t.Fatalf("the server's CloseWrite: %v", err)
	}
	down, err := io.ReadAll(conn)
	if err != nil || string(down) != "down" {
		t.Fatalf("the client read %q, %v; want down and EOF", down, err)
	}
	if _, err := server.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the handler's read after EOF: %v", err)
	}
}

// TestADispatchedFunctionRunsOnceGRPCHasClearedItsDeadline plays gRPC's
// part by hand on a connection a HandOver listener accepted: the handshake,
// then the clear of its deadline, the last thing gRPC does with a
// dispatched connection. The function must not run before that clear,
// which would undo a deadline of its own.
func TestADispatchedFunctionRunsOnceGRPCHasClearedItsDeadline(t *testing.T) {
	ca := newCA(t, "ca")
	server := newSource(t, ca, devca.Leaf{SPIFFEID: "/broker"})
	client := newSource(t, ca, devca.Leaf{SPIFFEID: "/agent"})
	served := make(chan struct{})
	creds := Dispatch(ServerCredentials(server, tlsconfig.AuthorizeAny(), Protocols(testProtocol)),
		map[string]func(net.Conn, AuthInfo){testProtocol: func(conn net.Conn, _ AuthInfo) {
			close(served)
			conn.Close()
		}})
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lis := HandOver(l)
	defer lis.Close()
	go func() {
		raw, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			return
		}
		defer raw.Close()
		conn, _, err := ClientCredentials(client, tlsconfig.AuthorizeAny(), Protocols(testProtocol)).ClientHandshake(context.Background(), "broker", raw)
		if err == nil {
			_, _ = io.Copy(io.Discard, conn)
		}
	}()
	raw, err := lis.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	_ = raw.SetDeadline(time.Now().Add(waitLong))
	if _, _, err := creds.ServerHandshake(raw); !errors.Is(err, credentials.ErrConnDispatched) {
		t.Fatalf("ServerHandshake: %v, want the connection dispatched", err)
	}
	select {
	case <-served:
		t.Fatal("the function ran before gRPC cleared the connection's deadline")
	case <-time.After(100 * time.Millisecond):
	}
	_ = raw.SetDeadline(time.Time{})
	select {
	case <-served:
	case <-time.After(waitLong):
		t.Fatal("the function did not run once gRPC cleared the connection's deadline")
	}
}

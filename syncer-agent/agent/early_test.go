package agent

import (
	"io"
	"testing"
)

func TestTheAgentRegistersAsAcceptingEarlyData(t *testing.T) {
	s, _, _ := established(t)
	if !s.register.GetAcceptsEarlyData() {
		t.Error("the agent's registration does not say it accepts early data")
	}
}

func TestAnOrdersEarlyDataReachesTheTargetBeforeTheTunnelsData(t *testing.T) {
	order := dialOrder(1)
	order.EarlyData = []byte("client hello;")
	_, tu, conn := establishedBy(t, order)
	if err := tu.send([]byte("then data")); err != nil {
		t.Fatal(err)
	}
	if err := tu.closeWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(conn)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "client hello;then data" {
		t.Errorf("the target read %q, want the early data, then the tunnel's data", got)
	}
}

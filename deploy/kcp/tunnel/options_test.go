package tunnel

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr"
)

func TestValidateSaysWhatIsWrongWithTheFlags(t *testing.T) {
	t.Setenv("SPIFFE_ENDPOINT_SOCKET", "")
	tests := []struct {
		name string
		set  func(o *Options)
		want string // a part of the one error; empty: valid
	}{
		{name: "no tunnel", set: func(*Options) {}},
		{name: "a tunnel flag without --tunnel-broker", set: func(o *Options) { o.SPIFFESocket = "unix:///s.sock" }, want: "need --tunnel-broker"},
		{name: "the Workload API", set: func(o *Options) { o.Broker, o.SPIFFESocket = "dns:///b:8443", "unix:///s.sock" }},
		{name: "SVID files", set: func(o *Options) { o.Broker, o.SVIDCert, o.SVIDKey, o.TrustBundle = "b:8443", "c", "k", "t" }},
		{name: "no SVID source", set: func(o *Options) { o.Broker = "b:8443" }, want: "needs kcp's SVID"},
		{name: "two SVID sources", set: func(o *Options) {
			o.Broker, o.SPIFFESocket, o.SVIDCert, o.SVIDKey, o.TrustBundle = "b:8443", "unix:///s.sock", "c", "k", "t"
		}, want: "two sources"},
		{name: "a missing SVID file", set: func(o *Options) { o.Broker, o.SVIDCert, o.SVIDKey = "b:8443", "c", "k" }, want: "all three"},
		{name: "a broker ID that is no SPIFFE ID", set: func(o *Options) {
			o.Broker, o.SPIFFESocket, o.BrokerID = "b:8443", "unix:///s.sock", "https://example.org/broker"
		}, want: "--tunnel-broker-spiffe-id"},
		{name: "a zero dial timeout", set: func(o *Options) { o.Broker, o.SPIFFESocket, o.DialTimeout = "b:8443", "unix:///s.sock", 0 }, want: "must be positive"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := NewOptions()
			tt.set(o)
			errs := o.Validate()
			switch {
			case tt.want == "" && len(errs) > 0:
				t.Fatalf("Validate() = %v, want no error", errs)
			case tt.want != "" && (len(errs) != 1 || !strings.Contains(errs[0].Error(), tt.want)):
				t.Fatalf("Validate() = %v, want one error saying %q", errs, tt.want)
			}
		})
	}
}

func TestWorkloadAPISocketDefaultsToTheSPIFFEVariable(t *testing.T) {
	t.Setenv("SPIFFE_ENDPOINT_SOCKET", "unix:///from-env.sock")
	o := NewOptions()
	o.Broker = "b:8443"
	if errs := o.Validate(); len(errs) > 0 {
		t.Fatalf("Validate() = %v, want the socket from $SPIFFE_ENDPOINT_SOCKET", errs)
	}
	if got := o.socket(); got != "unix:///from-env.sock" {
		t.Fatalf("socket() = %q", got)
	}
}

func TestStartWithoutBrokerIsKcpAsReleased(t *testing.T) {
	wrapper, closeTunnel, err := NewOptions().Start(context.Background(), logr.Discard())
	if err != nil || wrapper != nil {
		t.Fatalf("Start() = %v, %v; want no wrapper and no error", wrapper != nil, err)
	}
	closeTunnel()
}

func TestStartGivesUpOnAWorkloadAPIThatNeverAnswers(t *testing.T) {
	o := NewOptions()
	o.Broker, o.SPIFFESocket, o.WorkloadAPITimeout = "b:8443", "unix://"+t.TempDir()+"/none.sock", 300*time.Millisecond
	_, _, err := o.Start(context.Background(), logr.Discard())
	if err == nil || !strings.Contains(err.Error(), "no X.509-SVID for kcp from the Workload API") {
		t.Fatalf("Start() error = %v, want it to say the Workload API gave no SVID", err)
	}
}

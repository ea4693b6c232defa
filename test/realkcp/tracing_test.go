package realkcp

import (
	"cmp"
	"fmt"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"

	"github.com/kcp-dev/tunnel-broker/test/harness"
)

// kcp started with tracing on (--tracing-config-file) puts the tunnel's
// spans into the trace of the webhook call that dialed it: the request's,
// kcp's webhook dispatcher's, kcpplugin's dial (in kcp), the broker's
// admission and dial, and the agent's order, lookup and connect; the
// broker lists the tunnel with that trace's id.
func TestRealKCPTracesAWebhookCallThroughTheTunnel(t *testing.T) {
	s := kcp(t)
	w := s.workspace(t, "t")
	wh := s.startStandIn(t, "t")
	s.agent(t, "t", w.cluster, wh.Addr)
	w.validating(t, wh.CABundle, admissionregistrationv1.Fail)

	w.eventuallyRefused(t, true, "denied by webhook t")

	// The call that first reached the webhook opened kcp's connection to
	// it, through the tunnel the broker lists: its trace is the dial's.
	var traceID string
	for _, tun := range s.tunnels(t, w.cluster) {
		traceID = cmp.Or(traceID, tun.TraceId)
	}
	if traceID == "" {
		t.Fatalf("no tunnel the broker lists to %s has a trace, though kcp traces every request", w.cluster)
	}
	t.Cleanup(func() {
		if t.Failed() {
			seen := map[string]int{}
			for _, sp := range s.otlp.Spans() {
				seen[fmt.Sprintf("%s %q in-trace=%v", sp.Service, sp.Name, sp.TraceID == traceID)]++
			}
			t.Logf("spans at the receiver: %v", seen)
		}
	})
	byName := map[string]harness.Span{}
	byID := map[string]harness.Span{}
	harness.Eventually(t, 30*time.Second, "kcp's, kcpplugin's, the broker's and the agent's spans in the trace "+traceID, func() bool {
		for _, sp := range s.otlp.Trace(traceID) {
			byName[sp.Name], byID[sp.SpanID] = sp, sp
		}
		for _, name := range []string{"Call validating webhook", "DialService", "admission", "dial", "order", "lookup", "connect"} {
			if _, ok := byName[name]; !ok {
				return false
			}
		}
		return true
	})
	dial := byName["DialService"]
	for _, sp := range s.otlp.Trace(traceID) {
		t.Logf("span %-26q of %-14s parent %-26q %v", sp.Name, sp.Service, byID[sp.ParentSpanID].Name, sp.End.Sub(sp.Start).Round(time.Microsecond))
	}

	kcpService := byName["Call validating webhook"].Service
	if dial.Service != kcpService || byID[dial.ParentSpanID].Service != kcpService {
		t.Errorf("kcpplugin's dial span came from %q under %q's span %q; want both kcp's (%q)",
			dial.Service, byID[dial.ParentSpanID].Service, byID[dial.ParentSpanID].Name, kcpService)
	}
	for span := byID[dial.ParentSpanID]; span.Name != "Call validating webhook"; span = byID[span.ParentSpanID] {
		if span.SpanID == "" {
			t.Fatalf("kcpplugin's dial span is not under kcp's webhook call span")
		}
	}
	admission, brokerDial, order := byName["admission"], byName["dial"], byName["order"]
	if admission.Service != "tunnel-broker" || admission.ParentSpanID != brokerDial.ParentSpanID {
		t.Errorf("the broker's admission and dial spans are not of one tunnel span: %+v, %+v", admission, brokerDial)
	}
	if order.Service != "syncer-agent" || order.ParentSpanID != brokerDial.SpanID {
		t.Errorf("the agent's order span (of %s) is not under the broker's dial span: parent %s, want %s", order.Service, order.ParentSpanID, brokerDial.SpanID)
	}
	if byName["lookup"].ParentSpanID != order.SpanID || byName["connect"].ParentSpanID != order.SpanID {
		t.Errorf("the agent's lookup and connect spans are not under its order span")
	}
	for _, sp := range []harness.Span{dial, admission, brokerDial, order, byName["connect"]} {
		if sp.Error {
			t.Errorf("span %q ended with an error: %s", sp.Name, sp.StatusMessage)
		}
	}
}

package authz

import (
	"log/slog"
	"testing"

	promtestutil "github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
	"github.com/kcp-dev/tunnel-broker/internal/testutil"
)

func TestDenyCountsWhatWasAskedAndAnswersPermissionDenied(t *testing.T) {
	denied := metrics.Denied.WithLabelValues(AskedCall)
	before := promtestutil.ToFloat64(denied)
	err := Deny(slog.New(slog.DiscardHandler), id("/agent").String(), AskedCall, "spiffe://example.org/agent may not call /x.Y/Z")
	testutil.CheckStatus(t, "Deny", err, codes.PermissionDenied, "spiffe://example.org/agent may not call /x.Y/Z")
	if got := promtestutil.ToFloat64(denied) - before; got != 1 {
		t.Errorf("denied_total{asked=call} rose by %v, want 1", got)
	}
}

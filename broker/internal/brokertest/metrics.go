package brokertest

import (
	"testing"

	"github.com/kcp-dev/tunnel-broker/broker/metrics"
)

// Metric is the value of the first series of family in the broker's
// metrics registry whose labels match (a counter's or a gauge's), and
// whether there is one.
func Metric(t testing.TB, family string, match func(labels map[string]string) bool) (float64, bool) {
	t.Helper()
	families, err := metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != family {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if match(labels) {
				if c := m.GetCounter(); c != nil {
					return c.GetValue(), true
				}
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

package bench

import (
	"slices"
	"time"
)

// Samples are latencies of one measurement.
type Samples []time.Duration

// Quantile is the q-quantile (0 <= q <= 1) by the nearest-rank method, or 0
// for no samples. It sorts s.
func (s Samples) Quantile(q float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}

// Micros is d in microseconds.
func Micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// Millis is d in milliseconds.
func Millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

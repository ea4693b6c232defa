package ops

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// Durations carry their unit in JSON logs too, where slog would write
// nanoseconds.
func TestDurationsCarryTheirUnit(t *testing.T) {
	var buf bytes.Buffer
	slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{ReplaceAttr: durationWithUnit})).Info("draining", "grace", 20*time.Second)
	if !strings.Contains(buf.String(), `"grace":"20s"`) {
		t.Errorf("got %s, want grace as \"20s\"", buf.String())
	}
}

package ops

import (
	"log/slog"
	"os"
)

// NewLogger logs to stderr, as text or JSON lines; verbose adds debug lines
// (every tunnel), which the default level leaves out. Durations are
// written with their unit ("1.5s"), in JSON too, where slog would write
// nanoseconds without one.
func NewLogger(json, verbose bool) *slog.Logger {
	opts := &slog.HandlerOptions{Level: slog.LevelInfo, ReplaceAttr: durationWithUnit}
	if verbose {
		opts.Level = slog.LevelDebug
	}
	if json {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

func durationWithUnit(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		a.Value = slog.StringValue(a.Value.Duration().String())
	}
	return a
}

package ops

import (
	"log/slog"
	"os"
)

// NewLogger logs to stderr, as text or JSON lines; verbose adds debug lines
// (every tunnel), which the default level leaves out.
func NewLogger(json, verbose bool) *slog.Logger {
	opts := &slog.HandlerOptions{Level: slog.LevelInfo}
	if verbose {
		opts.Level = slog.LevelDebug
	}
	if json {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

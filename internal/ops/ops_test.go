package ops

import (
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// A port already taken fails the start with the flag that chose it named.
func TestServeNamesTheFlagOfATakenPort(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	addr := taken.Addr().String()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{Listen: addr}, "--metrics-listen: listen tcp " + addr + ": bind: address already in use"},
		{Options{Pprof: addr}, "--pprof-listen: listen tcp " + addr + ": bind: address already in use"},
	} {
		tc.o.Metrics = prometheus.NewRegistry()
		err := Serve(t.Context(), tc.o, log)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Serve(%+v): %v, want %q", tc.o, err, tc.want)
		}
	}
}

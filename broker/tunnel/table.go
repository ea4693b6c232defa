package tunnel

import (
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// Table holds the tunnels open through a replica, for operators
// (AdminService.ListTunnels). Listing copies what it returns under the
// table's own lock, never the registry's, so it stops no dial.
type Table struct {
	mu   sync.Mutex
	live map[*Tunnel]struct{}
}

// NewTable is an empty table.
func NewTable() *Table { return &Table{live: map[*Tunnel]struct{}{}} }

// Add lists t until Remove.
func (tb *Table) Add(t *Tunnel) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	tb.live[t] = struct{}{}
}

// Remove stops listing t.
func (tb *Table) Remove(t *Tunnel) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	delete(tb.live, t)
}

// Filter selects tunnels: by cluster and caller when set, and only those
// whose id comes after After, at most Limit of them (> 0).
type Filter struct {
	Cluster string
	Caller  spiffeid.ID
	After   string
	Limit   int
}

// Info is what a listing says of one tunnel.
type Info struct {
	*Tunnel
	BytesUp, BytesDown int64
	// Idle is how long it has carried nothing, either way.
	Idle time.Duration
}

// List is the tunnels f selects, ordered by id, and whether more follow.
func (tb *Table) List(f Filter) (infos []Info, more bool) {
	var matched []*Tunnel
	tb.mu.Lock()
	for t := range tb.live {
		if (f.Cluster == "" || t.Target.GetCluster() == f.Cluster) &&
			(f.Caller.IsZero() || t.CallerID == f.Caller) && t.ID > f.After {
			matched = append(matched, t)
		}
	}
	tb.mu.Unlock()
	slices.SortFunc(matched, func(x, y *Tunnel) int { return strings.Compare(x.ID, y.ID) })
	if len(matched) > f.Limit {
		matched, more = matched[:f.Limit], true
	}
	for _, t := range matched {
		infos = append(infos, Info{Tunnel: t, BytesUp: t.bytesUp.Load(), BytesDown: t.bytesDown.Load(), Idle: t.quiet()})
	}
	return infos, more
}

// Bytes are the data bytes the tunnel carried so far, up (from the caller)
// and down.
func (t *Tunnel) Bytes() (up, down int64) { return t.bytesUp.Load(), t.bytesDown.Load() }

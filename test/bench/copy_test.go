package bench

import (
	"testing"
	"time"
)

// chunk is one benchmark op of a bulk transfer: b.N chunks go over one
// connection, so MB/s is the transfer's rate.
const chunk = 1 << 20

// BenchmarkDownload reads b.N MiB from the bulk target over one connection,
// in reads of 256 KiB: the target -> agent pipe -> splice -> kcpplugin
// receive goroutine -> Read path.
func BenchmarkDownload(b *testing.B) {
	for _, p := range paths {
		b.Run(p.name, func(b *testing.B) {
			c := dial(b, p.dial, "bulk")
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Minute))
			buf := make([]byte, BulkBuffer)
			b.SetBytes(chunk)
			b.ReportAllocs()
			b.ResetTimer()
			if err := Download(c, int64(b.N)*chunk, buf); err != nil {
				b.Fatal(err)
			}
		})
	}
}

// BenchmarkUpload writes b.N MiB to the bulk target over one connection, in
// writes of the given size, and waits for its acknowledgement: the Write
// (framing) -> splice -> agent pipe -> target path.
func BenchmarkUpload(b *testing.B) {
	for _, p := range paths {
		for _, w := range []int{4 << 10, 32 << 10, 256 << 10} {
			b.Run(p.name+"/write="+sizeName(w), func(b *testing.B) {
				c := dial(b, p.dial, "bulk")
				defer c.Close()
				_ = c.SetDeadline(time.Now().Add(5 * time.Minute))
				buf := make([]byte, w)
				b.SetBytes(chunk)
				b.ReportAllocs()
				b.ResetTimer()
				if err := Upload(c, int64(b.N)*chunk, buf); err != nil {
					b.Fatal(err)
				}
			})
		}
	}
}

package wire

import (
	"bytes"
	"strings"
	"testing"
)

// chunks hands out its chunks one per Read.
type chunks [][]byte

func (c *chunks) Read(p []byte) (int, error) {
	n := copy(p, (*c)[0])
	if n == len((*c)[0]) {
		*c = (*c)[1:]
	} else {
		(*c)[0] = (*c)[0][n:]
	}
	return n, nil
}

func TestReadBufferHoldsAPooledBufferOnlyWhileReadsAreLarge(t *testing.T) {
	large := bytes.Repeat([]byte("b"), 3*MaxFrame)
	src := chunks{[]byte("ping"), large, []byte("pong")}
	var b ReadBuffer
	var got []string
	var big []bool
	for len(src) > 0 {
		data, err := b.Read(&src)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, string(data))
		big = append(big, b.big != nil)
	}
	if strings.Join(got, "") != "ping"+string(large)+"pong" {
		t.Fatal("the bytes read are not the bytes sent")
	}
	// ping: small. Then 2 KiB fill the small buffer, and the rest comes
	// in MaxFrame reads into the big one; pong goes back to small.
	if len(got[1]) != smallRead || len(got[2]) != MaxFrame {
		t.Fatalf("reads of %d and %d bytes, want %d then %d", len(got[1]), len(got[2]), smallRead, MaxFrame)
	}
	if big[0] || !big[1] || !big[len(big)-2] || big[len(big)-1] {
		t.Fatalf("holding a big buffer after each read: %v; want only after reads that filled theirs", big)
	}
	b.Release()
}

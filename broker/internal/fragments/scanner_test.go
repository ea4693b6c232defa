package fragments

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"golang.org/x/net/http2"
)

// seen is a DATA frame as the scanner reports it.
type seen struct {
	stream uint32
	flags  http2.Flags
	length uint32
	data   uint32
}

// clientBytes is what a client sends: its preface, then the frames write
// writes with an x/net Framer.
func clientBytes(t *testing.T, write func(fr *http2.Framer) error) []byte {
	t.Helper()
	var b bytes.Buffer
	b.WriteString(http2.ClientPreface)
	if err := write(http2.NewFramer(&b, nil)); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// scanAll scans b in the pieces cuts makes of it and returns the DATA frames
// seen and the scanner.
func scanAll(b []byte, cuts []int) ([]seen, *scanner) {
	var got []seen
	s := newServerScanner(func(f http2.FrameHeader, data uint32) {
		got = append(got, seen{f.StreamID, f.Flags, f.Length, data})
	})
	last := 0
	for _, c := range cuts {
		s.scan(b[last:c])
		last = c
	}
	s.scan(b[last:])
	return got, s
}

func TestTheScannerSeesEveryDataFrameHoweverTheBytesAreCut(t *testing.T) {
	b := clientBytes(t, func(fr *http2.Framer) error {
		fr.AllowIllegalWrites = true // a padded frame with more padding than payload
		return errors.Join(
			fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20}),
			fr.WriteWindowUpdate(0, 1<<20),
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: []byte("headers"), EndHeaders: true}),
			fr.WriteData(1, false, make([]byte, 100)),
			fr.WriteData(1, false, []byte{1}),
			fr.WriteDataPadded(1, false, []byte{1, 2, 3}, make([]byte, 200)),
			fr.WriteDataPadded(1, false, nil, make([]byte, 5)),
			fr.WritePing(false, [8]byte{1}),
			fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 5, BlockFragment: []byte("headers"), EndHeaders: true}),
			fr.WriteData(5, false, make([]byte, 16384)),
			fr.WriteRawFrame(0x42, 0, 0, []byte("a frame of a type the scanner does not know")),
			fr.WriteData(3, true, nil),
			fr.WriteRawFrame(http2.FrameData, http2.FlagDataPadded, 7, []byte{9, 1, 2}),
			fr.WriteRawFrame(http2.FrameData, http2.FlagDataPadded, 7, nil),
		)
	})
	want := []seen{
		{1, 0, 100, 100},
		{1, 0, 1, 1},
		{1, http2.FlagDataPadded, 204, 3},
		{1, http2.FlagDataPadded, 6, 0},
		{5, 0, 16384, 16384},
		{3, http2.FlagDataEndStream, 0, 0},
		{7, http2.FlagDataPadded, 3, 0},
		{7, http2.FlagDataPadded, 0, 0},
	}
	check := func(how string, cuts []int) {
		t.Helper()
		got, s := scanAll(b, cuts)
		if !slices.Equal(got, want) {
			t.Fatalf("%s: saw %v, want %v", how, got, want)
		}
		if !s.atFrameStart() || s.lastStream != 5 {
			t.Fatalf("%s: at the end, at a frame's start %v, last stream %d; want true, 5", how, s.atFrameStart(), s.lastStream)
		}
	}
	check("in one piece", nil)
	for i := range len(b) {
		check("in two pieces", []int{i})
	}
	oneByOne := make([]int, len(b))
	for i := range oneByOne {
		oneByOne[i] = i
	}
	check("a byte at a time", oneByOne)
	rng := rand.New(rand.NewPCG(1, 2))
	for range 1000 {
		var cuts []int
		for c := rng.IntN(40); c < len(b); c += 1 + rng.IntN(40) {
			cuts = append(cuts, c)
		}
		check("in random pieces", cuts)
	}
}

func TestTheScannerKnowsWhereAFrameMayBegin(t *testing.T) {
	var s scanner // what a server writes: no preface
	var b bytes.Buffer
	fr := http2.NewFramer(&b, nil)
	if err := fr.WriteData(1, false, make([]byte, 20)); err != nil {
		t.Fatal(err)
	}
	frame := b.Bytes()
	for i := range len(frame) {
		s.scan(frame[i : i+1])
		if s.atFrameStart() != (i == len(frame)-1) {
			t.Fatalf("after %d of %d bytes, at a frame's start: %v", i+1, len(frame), s.atFrameStart())
		}
	}
}

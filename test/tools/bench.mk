# Benchmarks of issue 7: the tunnel against the direct path on loopback.
# See BENCHMARKS.md for the figures and how each is measured.

# This file is included before the main Makefile's first target: keep its
# default goal.
.DEFAULT_GOAL := all

BENCH_FLAGS ?=
BENCH_COUNT ?= 1
BENCH_TIME  ?= 1s

.PHONY: bench bench-go

## bench: broker and agent binaries on loopback, every figure tunneled vs direct (BENCH_FLAGS=-quick for a smoke run)
bench: build
	$(GO) run ./test/bench/cmd/tunnelbench $(BENCH_FLAGS)
	$(GO) run ./test/bench/cmd/streamfloor

## bench-go: the Go benchmarks of the hot paths, in process (benchstat-friendly; BENCH_COUNT, BENCH_TIME)
bench-go:
	$(GO) test -run '^$$' -bench . -benchmem -count $(BENCH_COUNT) -benchtime $(BENCH_TIME) ./test/bench/

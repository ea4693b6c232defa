# Benchmarks of issues 7 and 18: the tunnel against the direct path, two
# plain TLS relays, a bare gRPC stream and a real peer (rancher's
# remotedialer), on loopback. See BENCHMARKS.md for the figures and how each
# is measured.

# This file is included before the main Makefile's first target: keep its
# default goal.
.DEFAULT_GOAL := all

BENCH_FLAGS ?=
BENCH_COUNT ?= 1
BENCH_TIME  ?= 1s

.PHONY: bench bench-latency bench-go bench-peers

## bench: broker and agent binaries on loopback, every figure tunneled vs direct, the relays and the remotedialer peer (BENCH_FLAGS=-quick for a smoke run)
bench: build
	@peer=$$(GO="$(GO)" test/bench/peers/remotedialer/build.sh) && \
	  echo "$(GO) run ./test/bench/cmd/tunnelbench -peer-remotedialer $$peer $(BENCH_FLAGS)" && \
	  $(GO) run ./test/bench/cmd/tunnelbench -peer-remotedialer "$$peer" $(BENCH_FLAGS)
	$(GO) run ./test/bench/cmd/streamfloor

# What make bench-latency runs: 250 µs on every hop, and the phases whose
# figures a user on a real network sees (64 B echo, dial + first echo, the
# webhook on kept-alive and new connections). BENCH_FLAGS come after, so
# they can change any of it.
BENCH_LATENCY_FLAGS ?= -hop-delay 250us -phases latency,dial,webhook

## bench-latency: make bench's echo, dial + first echo and webhook figures with 250 µs on every hop, each way (-hop-delay: a delaying relay per connection)
bench-latency: build
	@peer=$$(GO="$(GO)" test/bench/peers/remotedialer/build.sh) && \
	  echo "$(GO) run ./test/bench/cmd/tunnelbench -peer-remotedialer $$peer $(BENCH_LATENCY_FLAGS) $(BENCH_FLAGS)" && \
	  $(GO) run ./test/bench/cmd/tunnelbench -peer-remotedialer "$$peer" $(BENCH_LATENCY_FLAGS) $(BENCH_FLAGS)

## bench-peers: the remotedialer peer's binary (test/bench/peers/remotedialer, its own module and Go) into .cache/, if missing
bench-peers:
	@GO="$(GO)" test/bench/peers/remotedialer/build.sh >/dev/null

## bench-go: the Go benchmarks of the hot paths, in process (benchstat-friendly; BENCH_COUNT, BENCH_TIME)
bench-go:
	$(GO) test -run '^$$' -bench . -benchmem -count $(BENCH_COUNT) -benchtime $(BENCH_TIME) ./test/bench/

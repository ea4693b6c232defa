# Native Go fuzz targets. go test -fuzz takes one package and one target per
# run, so each runs on its own: make fuzz for FUZZTIME each, make test for a
# short budget each (fuzz-short). An input that fails is written to the
# package's testdata/fuzz/<target>/, where plain go test runs it from then on.

# This file is included before the main Makefile's first target: keep its
# default goal.
.DEFAULT_GOAL := all

FUZZTIME ?= 60s

# package:target:short budget. The short budgets, run by make test, count
# executions (about 5 s of each target here) rather than seconds: on go1.26 a
# duration -fuzztime can fail at its very end with a spurious "context
# deadline exceeded" and no failing input (a race in the fuzz coordinator,
# go.dev/issue/75804, fixed in go1.27), and a count has no deadline to race.
FUZZ_TARGETS := \
	./proto/kcp/tunnel/v1:FuzzTargetValidate:25000x \
	./proto/kcp/tunnel/v1:FuzzDialRequestDecode:30000x \
	./test/fuzz:FuzzValidateAgainstApimachinery:35000x \
	./kcpplugin:FuzzCallerFrames:600x \
	./internal/identity:FuzzHandshakeURISAN:3000x

# $(call fuzz-each,budget): budget is a -fuzztime, or "short" for each
# target's own.
fuzz-each = set -e; for t in $(FUZZ_TARGETS); do \
	  pkg=$$(echo $$t | cut -d: -f1); name=$$(echo $$t | cut -d: -f2); \
	  budget=$(1); [ "$$budget" = short ] && budget=$$(echo $$t | cut -d: -f3); \
	  echo "fuzz: $$name in $$pkg for $$budget"; \
	  $(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime $$budget $$pkg; \
	done

.PHONY: fuzz fuzz-short

## fuzz: every fuzz target for FUZZTIME (60s) each
fuzz:
	@$(call fuzz-each,$(FUZZTIME))

## fuzz-short: every fuzz target for its short budget (about 5s); part of make test
fuzz-short:
	@$(call fuzz-each,short)

test: fuzz-short

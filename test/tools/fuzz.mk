# Native Go fuzz targets. go test -fuzz takes one package and one target per
# run, so each runs on its own: make fuzz for FUZZTIME each, make test for
# FUZZTIME_SHORT each (fuzz-short). An input that fails is written to the
# package's testdata/fuzz/<target>/, where plain go test runs it from then on.

# This file is included before the main Makefile's first target: keep its
# default goal.
.DEFAULT_GOAL := all

FUZZTIME       ?= 60s
FUZZTIME_SHORT ?= 5s

# package:target
FUZZ_TARGETS := \
	./proto/kcp/tunnel/v1:FuzzTargetValidate \
	./proto/kcp/tunnel/v1:FuzzDialRequestDecode \
	./test/fuzz:FuzzValidateAgainstApimachinery \
	./kcpplugin:FuzzCallerFrames

# $(call fuzz-each,duration)
fuzz-each = set -e; for t in $(FUZZ_TARGETS); do \
	  pkg=$$(echo $$t | cut -d: -f1); name=$$(echo $$t | cut -d: -f2); \
	  echo "fuzz: $$name in $$pkg for $(1)"; \
	  $(GO) test -run '^$$' -fuzz "^$$name$$" -fuzztime $(1) $$pkg; \
	done

.PHONY: fuzz fuzz-short

## fuzz: every fuzz target for FUZZTIME (60s) each
fuzz:
	@$(call fuzz-each,$(FUZZTIME))

## fuzz-short: every fuzz target for FUZZTIME_SHORT (5s) each; part of make test
fuzz-short:
	@$(call fuzz-each,$(FUZZTIME_SHORT))

test: fuzz-short

# SPIRE server and agent for the end-to-end test against a real SPIRE
# (test/spire), pinned in test/tools/spire/go.mod and built by build.sh
# there into a git-ignored folder keyed by version and go.sum, only when
# missing. The tests ask build.sh for the folder.

# This file is included before the main Makefile's first target: keep its
# default goal.
.DEFAULT_GOAL := all

.PHONY: spire spire-os-deps

## spire: spire-server and spire-agent into .cache/spire-<version>-<sum>/, if missing; prints the folder
spire: spire-os-deps
	@GO="$(GO)" test/tools/spire/build.sh

# The test runs workloads as system users (useradd, runuser); the sqlite
# datastore needs cgo (gcc, libc headers). All are in Debian's base and
# build-essential; install what is missing.
spire-os-deps:
	@missing=; \
	  command -v useradd >/dev/null || missing="$$missing passwd"; \
	  command -v runuser >/dev/null || missing="$$missing util-linux"; \
	  command -v gcc >/dev/null || missing="$$missing gcc libc6-dev"; \
	  if [ -n "$$missing" ]; then \
	    echo "installing$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  fi

test: spire

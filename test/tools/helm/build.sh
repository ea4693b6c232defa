#!/bin/sh
# Builds helm at the version pinned in this folder's go.mod (a tool
# directive), unless that build is already cached, and prints the path of
# the binary. The cache is the repo's git-ignored .cache/helm-<version>-<sum>/
# (or under $HELM_TOOLS_CACHE), <sum> a digest of go.sum, so a second run
# only checks that the binary is there and a change of any dependency
# builds anew.
# This module is separate from the root and test modules so that helm's
# dependency graph does not move their k8s.io versions.
# make helm-tools and the Deploy tests (test/deploy) call this.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
cache=${HELM_TOOLS_CACHE:-$(cd "$here/../../.." && pwd)/.cache}
cd "$here"
# This module is deliberately outside the repo's go.work.
export GOWORK=off

version=$(awk '$1 == "helm.sh/helm/v4" { print $2 }' go.mod)
[ -n "$version" ] || { echo "no helm.sh/helm/v4 in $here/go.mod" >&2; exit 1; }
dir=$cache/helm-$version-$(sha256sum go.sum | cut -c1-12)
if [ -x "$dir/helm" ]; then
	echo "$dir/helm"
	exit 0
fi

mkdir -p "$cache"
# Tests of several packages may ask at once: one builds, the others wait.
exec 9>"$dir.lock"
flock 9
if [ ! -x "$dir/helm" ]; then
	tmp=$(mktemp -d "$cache/.helm-build-XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	echo "building helm $version into $dir" >&2
	# As helm's own Makefile stamps it: helm version, and the user agent.
	# Built as go vet builds the workspace (no -trimpath), so that the
	# packages both build at the same versions (test/tools/shared_test.go)
	# are compiled once.
	"${GO:-go}" build -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$version" \
		-o "$tmp/helm" helm.sh/helm/v4/cmd/helm
	mkdir -p "$dir"
	mv "$tmp/helm" "$dir/"
fi
echo "$dir/helm"

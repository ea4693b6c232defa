#!/bin/sh
# Builds remotedialer-peer (this folder's main package, which imports
# rancher/remotedialer at the version go.mod pins) with the Go toolchain that
# go.mod names, into the repo's git-ignored .cache/, unless it is there, and
# prints the binary's path. The folder is keyed by remotedialer's version and
# a hash of this folder's sources, so an edit here builds anew.
#
# This module is deliberately outside the repo's go.work: remotedialer needs a
# newer Go than the repo's. The first build on a machine downloads that
# toolchain through the Go module proxy (about 76 MB) and compiles the
# standard library with it: about a minute on 2 cores; then only a check.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../../.." && pwd)
version=$(awk '$1 == "github.com/rancher/remotedialer" { print $2 }' "$here/go.mod")
goversion=$(awk '$1 == "go" { print $2 }' "$here/go.mod")
[ -n "$version" ] && [ -n "$goversion" ] || { echo "no remotedialer or go version in $here/go.mod" >&2; exit 1; }
hash=$(cd "$here" && cat go.mod go.sum *.go | sha256sum | cut -c1-12)
dir="$root/.cache/remotedialer-$version-$hash"
bin="$dir/remotedialer-peer"
if [ ! -x "$bin" ]; then
	mkdir -p "$root/.cache"
	# Tests and make may ask at once: one builds, the others wait.
	exec 9>"$dir.lock"
	flock 9
	if [ ! -x "$bin" ]; then
		echo "building remotedialer-peer (remotedialer $version, go$goversion) into $dir" >&2
		# Build aside and move into place, so an interrupted build leaves no
		# binary that looks complete.
		tmp=$(mktemp -d "$root/.cache/remotedialer-build.XXXXXX")
		trap 'rm -rf "$tmp"' EXIT
		(cd "$here" && GOWORK=off GOTOOLCHAIN="go$goversion" "${GO:-go}" build -o "$tmp/remotedialer-peer" .)
		mkdir -p "$dir"
		mv "$tmp/remotedialer-peer" "$bin"
	fi
fi
echo "$bin"

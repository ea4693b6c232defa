#!/bin/sh
# Builds spire-server and spire-agent, at the version go.mod here pins, into
# the repo's git-ignored .cache/spire-<version>-<sum>/ (<sum>: a digest of
# go.sum, so that a change of any dependency builds anew) unless they are
# there, and prints that folder. Cold, the build takes many minutes and ~4 GiB of
# memory; with a warm Go build cache it only relinks.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
version=$(awk '$1 == "github.com/spiffe/spire" { print $2 }' "$here/go.mod")
[ -n "$version" ] || { echo "no github.com/spiffe/spire in $here/go.mod" >&2; exit 1; }
dir="$root/.cache/spire-$version-$(sha256sum "$here/go.sum" | cut -c1-12)"
if [ ! -x "$dir/spire-server" ] || [ ! -x "$dir/spire-agent" ]; then
	echo "building SPIRE $version into $dir" >&2
	mkdir -p "$root/.cache"
	# Build aside and move into place, so an interrupted build leaves no
	# binary that looks complete.
	tmp=$(mktemp -d "$root/.cache/spire-build.XXXXXX")
	trap 'rm -rf "$tmp"' EXIT
	(cd "$here" && GOWORK=off CGO_ENABLED=1 "${GO:-go}" build -o "$tmp/" \
		github.com/spiffe/spire/cmd/spire-server github.com/spiffe/spire/cmd/spire-agent)
	mkdir -p "$dir"
	mv "$tmp/spire-server" "$tmp/spire-agent" "$dir/"
fi
echo "$dir"

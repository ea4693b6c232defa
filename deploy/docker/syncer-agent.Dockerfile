# syntax=docker/dockerfile:1
# The syncer-agent (a sidecar of kcp's syncer): a static binary in an image
# with nothing else, run as a non-root user. Build from the repository's top
# folder (BuildKit):
#
#   docker build -f deploy/docker/syncer-agent.Dockerfile -t localhost/kcp-dev/tunnel-syncer-agent:dev .
#
# deploy/README.md has the details.

ARG GO_VERSION=1.26
# The final stage's base: scratch, or a distroless static image
# (--build-arg RUNTIME_IMAGE=...) if you want its /etc/passwd and CA
# certificates; the binary needs neither.
ARG RUNTIME_IMAGE=scratch

# The builder runs on the build machine's platform and cross-compiles for
# the target's (docker buildx build --platform ...), with no emulation.
FROM --platform=$BUILDPLATFORM golang:${GO_VERSION} AS build
ARG TARGETOS TARGETARCH
# What --version and the build_info metric report, as make stamps them:
# --build-arg VERSION=$(cat VERSION) --build-arg COMMIT=$(git rev-parse --short=12 HEAD)
ARG VERSION=unknown COMMIT=unknown
WORKDIR /src
# Static (no cgo), with no local paths in the binary, built from the root
# module's own go.mod (go.work also holds the test module, which is not in
# the build context: see .dockerignore).
ENV CGO_ENABLED=0 GOWORK=off
COPY . .
# The cache mounts keep modules and compiled packages between builds.
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    GOOS=$TARGETOS GOARCH=$TARGETARCH go build -trimpath -ldflags="-s -w -X github.com/kcp-dev/tunnel-broker/internal/version.version=${VERSION} -X github.com/kcp-dev/tunnel-broker/internal/version.commit=${COMMIT}" -o /out/syncer-agent ./syncer-agent

FROM ${RUNTIME_IMAGE}
COPY --from=build /out/syncer-agent /syncer-agent
# distroless' nonroot user, and the runAsUser of deploy/'s manifests.
USER 65532:65532
ENTRYPOINT ["/syncer-agent"]

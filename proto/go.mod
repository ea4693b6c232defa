// The wire API, released with kcpplugin (proto/vX.Y.Z tags). Like
// kcpplugin, it asks for no more than kcp v0.28.1 has, so that it never
// raises a consumer's: Go 1.23.0, grpc v1.69.2 (mem buffers and
// SupportPackageIsVersion9 need v1.66) and protobuf v1.36.2. The generated
// code (protoc-gen-go v1.36.12 and protoc-gen-go-grpc v1.6.2, pinned in the
// top go.mod) builds and passes the tests on these runtimes, so it is kept
// as generated.
module github.com/kcp-dev/tunnel-broker/proto

go 1.23.0

require (
	google.golang.org/grpc v1.69.2
	google.golang.org/protobuf v1.36.2
)

require (
	golang.org/x/net v0.30.0 // indirect
	golang.org/x/sys v0.26.0 // indirect
	golang.org/x/text v0.19.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20241015192408-796eee8c2d53 // indirect
)

// The wire API, released with kcpplugin (proto/vX.Y.Z tags). It requires
// the oldest gRPC and protobuf runtime kcpplugin supports (grpc v1.72.2:
// mem buffers and SupportPackageIsVersion9 need v1.66), so that it never
// raises a consumer's.
module github.com/kcp-dev/tunnel-broker/proto

go 1.25.0

require (
	go.uber.org/goleak v1.3.0
	google.golang.org/grpc v1.72.2
	google.golang.org/protobuf v1.36.8
)

require (
	golang.org/x/net v0.35.0 // indirect
	golang.org/x/sys v0.30.0 // indirect
	golang.org/x/text v0.22.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20250218202821-56aae31c358a // indirect
)

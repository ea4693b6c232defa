module github.com/kcp-dev/tunnel-broker/test

go 1.26.0

require (
	github.com/spiffe/go-spiffe/v2 v2.9.0 // indirect
	go.uber.org/goleak v1.3.0 // indirect
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1 // indirect
	google.golang.org/grpc v1.85.0 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
	k8s.io/api v0.37.2 // indirect
	k8s.io/apiserver v0.37.2 // indirect
	k8s.io/client-go v0.37.2 // indirect
)

require (
	github.com/kcp-dev/tunnel-broker v0.0.0-00010101000000-000000000000
	github.com/kcp-dev/tunnel-broker/proto v0.0.0-00010101000000-000000000000
	github.com/kcp-dev/tunnel-broker/kcpplugin v0.0.0-00010101000000-000000000000
)

replace (
	github.com/kcp-dev/tunnel-broker => ../
	github.com/kcp-dev/tunnel-broker/proto => ../proto
	github.com/kcp-dev/tunnel-broker/kcpplugin => ../kcpplugin
)

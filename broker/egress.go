package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"

	"github.com/kcp-dev/tunnel-broker/broker/server"
	"github.com/kcp-dev/tunnel-broker/internal/flagcheck"
	tunnelv1 "github.com/kcp-dev/tunnel-broker/proto/kcp/tunnel/v1"
)

// egressFlags choose the CONNECT front ends (package egress): a Unix
// socket for an API server in the same pod, whose connections all go to
// one logical cluster, and a TCP listener with SPIFFE mTLS, whose callers
// go to the cluster of their egress rule in the policy.
type egressFlags struct {
	uds, udsCluster, tcp string
}

func (f *egressFlags) add(fs *flag.FlagSet) {
	fs.StringVar(&f.uds, "egress-uds", "", "Unix socket to serve HTTP CONNECT on for kube-apiserver's egress selector (empty: off); who can open it reaches --egress-uds-cluster")
	fs.StringVar(&f.udsCluster, "egress-uds-cluster", "", "the logical cluster whose Services --egress-uds reaches")
	fs.StringVar(&f.tcp, "egress-listen", "", "TCP address to serve HTTP CONNECT on, with SPIFFE mTLS, for kube-apiserver's egress selector (empty: off); each caller reaches the cluster of its egress rule")
}

// check refuses a Unix socket without its cluster, and a cluster without
// its socket.
func (f *egressFlags) check() error {
	switch {
	case f.uds != "" && f.udsCluster == "":
		return flagcheck.Errorf("--egress-uds %s needs --egress-uds-cluster: the logical cluster whose Services its callers reach", f.uds)
	case f.uds == "" && f.udsCluster != "":
		return flagcheck.Errorf("--egress-uds-cluster %s needs --egress-uds: the Unix socket to serve CONNECT on", f.udsCluster)
	case f.udsCluster != "":
		if err := tunnelv1.ValidateClusterName(f.udsCluster); err != nil {
			return flagcheck.Errorf("--egress-uds-cluster: %w", err)
		}
	}
	return nil
}

// listen starts the front ends the flags ask for, on srv; the function it
// returns waits for them after srv stopped.
func (f *egressFlags) listen(srv *server.Server, log *slog.Logger) (wait func() error, err error) {
	var listeners []net.Listener
	var served []chan error
	ctx, stop := context.WithCancel(context.Background())
	start := func(l net.Listener, name string, serve func(context.Context, net.Listener) error) {
		listeners = append(listeners, l)
		ch := make(chan error, 1)
		served = append(served, ch)
		log.Info("egress front end serving", "frontend", name, "address", l.Addr().String())
		go func() { ch <- serve(ctx, l) }()
	}
	if f.uds != "" {
		l, err := f.listenUDS()
		if err != nil {
			stop()
			return nil, fmt.Errorf("--egress-uds: %w", err)
		}
		start(l, "uds", srv.EgressUDS(f.udsCluster).Serve)
	}
	if f.tcp != "" {
		l, err := net.Listen("tcp", f.tcp)
		if err != nil {
			stop()
			return nil, errors.Join(fmt.Errorf("--egress-listen: %w", err), closeAll(listeners))
		}
		start(l, "tls", srv.EgressTLS().Serve)
	}
	return func() error {
		stop()
		var errs []error
		for _, ch := range served {
			errs = append(errs, <-ch)
		}
		return errors.Join(errs...)
	}, nil
}

// listenUDS listens on the socket, replacing a stale one, open to the
// broker's user and group only (an API server in the same pod shares the
// pod's fsGroup): who may connect to it reaches the cluster's Services, so
// its directory and mode are the operator's control.
func (f *egressFlags) listenUDS() (net.Listener, error) {
	if err := os.Remove(f.uds); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	l, err := net.Listen("unix", f.uds)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(f.uds, 0o660); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

func closeAll(ls []net.Listener) error {
	var errs []error
	for _, l := range ls {
		errs = append(errs, l.Close())
	}
	return errors.Join(errs...)
}

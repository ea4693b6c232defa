package harness

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// KubeCluster is a real etcd and a real kube-apiserver, run for tests inside
// the isolated network namespace (RunIsolated). No controller manager runs:
// tests write what controllers would, EndpointSlices included.
type KubeCluster struct {
	dir, bin string
	pki      *kubePKI
	// Host is the API server's URL, on IsolatedAPIServerIP.
	Host      string
	etcd      *Daemon
	apiServer *Daemon
	// ExtraArgs are added to kube-apiserver's flags at its next start,
	// e.g. --egress-selector-config-file.
	ExtraArgs []string
}

const (
	etcdClientURL = "http://127.0.0.1:2379"
	etcdPeerURL   = "http://127.0.0.1:2380"
	apiServerPort = "6443"
)

// StartKubeCluster starts etcd and kube-apiserver with their state and logs
// in dir, and waits until the API server is ready. It refuses to run outside
// the isolated network namespace.
func StartKubeCluster(dir string) (*KubeCluster, error) {
	if err := CheckIsolated(); err != nil {
		return nil, err
	}
	bin, err := KubeBinaries()
	if err != nil {
		return nil, err
	}
	pki, err := newKubePKI()
	if err != nil {
		return nil, err
	}
	c := &KubeCluster{dir: dir, bin: bin, pki: pki, Host: "https://" + net.JoinHostPort(IsolatedAPIServerIP, apiServerPort)}
	if err := c.writeServingFiles(); err != nil {
		return nil, err
	}
	if err := c.startEtcd(); err != nil {
		c.Stop()
		return nil, err
	}
	if err := c.StartAPIServer(); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

func (c *KubeCluster) path(name string) string { return filepath.Join(c.dir, name) }

// writeServingFiles writes the CA, the API server's serving certificate and
// its service-account signing key.
func (c *KubeCluster) writeServingFiles() error {
	cert, key, err := c.pki.issue("kube-apiserver", nil,
		[]net.IP{net.ParseIP(IsolatedAPIServerIP), net.IPv4(127, 0, 0, 1), net.ParseIP("10.0.0.1")},
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"})
	if err != nil {
		return err
	}
	saKey, err := newKey()
	if err != nil {
		return err
	}
	// kube-apiserver reads a public key from a private key file only in
	// the SEC1 form.
	saDER, err := x509.MarshalECPrivateKey(saKey)
	if err != nil {
		return err
	}
	saPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: saDER})
	for name, data := range map[string][]byte{"ca.crt": c.pki.CAPEM, "apiserver.crt": cert, "apiserver.key": key, "sa.key": saPEM} {
		if err := os.WriteFile(c.path(name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

func (c *KubeCluster) startEtcd() error {
	d, err := StartDaemon(filepath.Join(c.bin, "etcd"), c.path("etcd.log"), nil,
		"--name=test", "--data-dir="+c.path("etcd"),
		"--listen-client-urls="+etcdClientURL, "--advertise-client-urls="+etcdClientURL,
		"--listen-peer-urls="+etcdPeerURL, "--initial-advertise-peer-urls="+etcdPeerURL,
		"--initial-cluster=test="+etcdPeerURL,
		"--unsafe-no-fsync", "--log-level=warn")
	if err != nil {
		return err
	}
	c.etcd = d
	return d.WaitReady("etcd", time.Minute, func(ctx context.Context) error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, etcdClientURL+"/health", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if !strings.Contains(string(body), `"health":"true"`) {
			return fmt.Errorf("etcd health: %s", body)
		}
		return nil
	})
}

// StartAPIServer starts kube-apiserver (again, after StopAPIServer) and
// waits until /readyz answers ok.
func (c *KubeCluster) StartAPIServer() error {
	d, err := StartDaemon(filepath.Join(c.bin, "kube-apiserver"), c.path("kube-apiserver.log"), nil, append([]string{
		"--etcd-servers=" + etcdClientURL,
		"--bind-address=" + IsolatedAPIServerIP, "--advertise-address=" + IsolatedAPIServerIP,
		"--secure-port=" + apiServerPort,
		"--cert-dir=" + c.path("apiserver-certs"),
		"--tls-cert-file=" + c.path("apiserver.crt"), "--tls-private-key-file=" + c.path("apiserver.key"),
		"--client-ca-file=" + c.path("ca.crt"),
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + c.path("sa.key"), "--service-account-signing-key-file=" + c.path("sa.key"),
		"--service-cluster-ip-range=10.0.0.0/24",
		// The test writes EndpointSlices itself; nothing reconciles the
		// API server's own endpoints.
		"--endpoint-reconciler-type=none",
		"--enable-priority-and-fairness=false",
		"--profiling=false",
		"--v=1"}, c.ExtraArgs...)...)
	if err != nil {
		return err
	}
	c.apiServer = d
	admin, err := c.Config("test-admin", "system:masters")
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(admin)
	if err != nil {
		return err
	}
	return d.WaitReady("kube-apiserver", time.Minute, func(ctx context.Context) error {
		body, err := client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err != nil {
			return err
		}
		if string(body) != "ok" {
			return fmt.Errorf("readyz: %s", body)
		}
		return nil
	})
}

// StopAPIServer stops kube-apiserver, leaving etcd and its state.
func (c *KubeCluster) StopAPIServer() error {
	if c.apiServer == nil {
		return nil
	}
	d := c.apiServer
	c.apiServer = nil
	return d.Stop()
}

// Stop stops both servers.
func (c *KubeCluster) Stop() {
	_ = c.StopAPIServer()
	if c.etcd != nil {
		_ = c.etcd.Stop()
		c.etcd = nil
	}
}

// Config is a client config for user in groups, authenticated by a client
// certificate: "system:masters" is the administrator; any other user has
// only what RBAC grants it.
func (c *KubeCluster) Config(user string, groups ...string) (*rest.Config, error) {
	cert, key, err := c.pki.issue(user, groups, nil, nil)
	if err != nil {
		return nil, err
	}
	return &rest.Config{
		Host:            c.Host,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.pki.CAPEM, CertData: cert, KeyData: key},
		// Tests stop the API server: fail requests fast, not after minutes.
		Timeout: 10 * time.Second,
	}, nil
}

// Kubeconfig writes a kubeconfig file for user in groups, as an agent
// binary would be given one.
func (c *KubeCluster) Kubeconfig(user string, groups ...string) (string, error) {
	cfg, err := c.Config(user, groups...)
	if err != nil {
		return "", err
	}
	path := c.path("kubeconfig-" + user)
	return path, clientcmd.WriteToFile(clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{"test": {Server: cfg.Host, CertificateAuthorityData: cfg.CAData}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{user: {ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData}},
		Contexts:       map[string]*clientcmdapi.Context{"test": {Cluster: "test", AuthInfo: user}},
		CurrentContext: "test",
	}, path)
}

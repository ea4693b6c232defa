package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
)

var (
	spireOnce sync.Once
	spireDir  string
	spireErr  error
)

// SPIREBinaries returns the folder that holds spire-server and spire-agent:
// $SPIRE_BIN_DIR when set, else the folder in the repo's .cache/ that
// test/tools/spire/build.sh builds at the versions test/tools/spire/go.mod
// pins if it is not there yet (many minutes cold; a relink with a warm Go
// build cache).
func SPIREBinaries(t T) string {
	t.Helper()
	spireOnce.Do(func() {
		if dir := os.Getenv("SPIRE_BIN_DIR"); dir != "" {
			spireDir = dir
			for _, name := range []string{"spire-server", "spire-agent"} {
				if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
					spireErr = fmt.Errorf("$SPIRE_BIN_DIR: %w", err)
				}
			}
			return
		}
		_, self, _, ok := runtime.Caller(0)
		if !ok {
			spireErr = errors.New("cannot locate the harness source to find test/tools/spire")
			return
		}
		script := filepath.Join(filepath.Dir(self), "..", "tools", "spire", "build.sh")
		cmd := exec.Command(script)
		cmd.Stderr = os.Stderr
		out, err := cmd.Output()
		if err != nil {
			spireErr = fmt.Errorf("%s: %w", script, err)
			return
		}
		spireDir = strings.TrimSpace(string(out))
	})
	if spireErr != nil {
		t.Fatal(spireErr)
	}
	return spireDir
}

// SharedDir is a temp dir that every user may read and search, for files
// that workloads running as other users read (policies, service tables,
// binaries) and for the Workload API socket. It is removed at cleanup.
// t.TempDir's folders are private to root.
func SharedDir(t T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "tunnel-shared-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	must(t, os.Chmod(dir, 0o755))
	return dir
}

var userMu sync.Mutex

// SystemUser makes sure a system user named name exists (useradd -r; no
// home, no login shell) and returns it. The user is left in place: it is
// cheap, and the next run reuses it.
func SystemUser(t T, name string) *user.User {
	t.Helper()
	userMu.Lock()
	defer userMu.Unlock()
	if u, err := user.Lookup(name); err == nil {
		return u
	}
	out, err := exec.Command("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
		"--user-group", name).CombinedOutput()
	// exit 9: another process created it meanwhile.
	if err != nil && !strings.Contains(string(out), "already exists") {
		t.Fatalf("useradd %s: %v\n%s", name, err, out)
	}
	u, err := user.Lookup(name)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// AsUser is the command prefix that runs a program as user name.
func AsUser(name string) []string { return []string{"runuser", "-u", name, "--"} }

// SPIREEntry is a workload registration entry.
type SPIREEntry struct {
	SPIFFEID  spiffeid.ID
	Selectors []string // e.g. "unix:user:tunnel-broker", "unix:uid:0"
	// X509SVIDTTL is the lifetime of the entry's SVIDs; zero is the
	// server's default (1h).
	X509SVIDTTL time.Duration
	DNSNames    []string
}

// SPIREOptions describe a SPIRE deployment.
type SPIREOptions struct {
	// TrustDomain defaults to spire.test.
	TrustDomain string
	// Entries are registered before the agent starts, so the agent's
	// first sync brings them.
	Entries []SPIREEntry
}

// SPIRE is a real SPIRE server and agent on loopback, for one test: the
// server with a sqlite datastore and join-token node attestation, the agent
// with the unix workload attestor. Both run as root.
type SPIRE struct {
	TrustDomain spiffeid.TrustDomain
	// WorkloadAPI is the agent's Workload API address (unix://...);
	// every user may connect to it.
	WorkloadAPI string
	// AgentID is the agent's SPIFFE ID: the parent of workload entries.
	AgentID spiffeid.ID
	Server  *Command
	Agent   *Command

	bin          string
	serverSocket string
}

// StartSPIRE starts a SPIRE server and agent and waits until both are
// healthy. They stop with the test.
func StartSPIRE(t T, opts SPIREOptions) *SPIRE {
	t.Helper()
	if opts.TrustDomain == "" {
		opts.TrustDomain = "spire.test"
	}
	td, err := spiffeid.TrustDomainFromString(opts.TrustDomain)
	if err != nil {
		t.Fatal(err)
	}
	bin := SPIREBinaries(t)
	dir := SharedDir(t)
	sockDir := filepath.Join(dir, "workload")
	must(t, os.Mkdir(sockDir, 0o755))
	s := &SPIRE{
		TrustDomain:  td,
		WorkloadAPI:  "unix://" + filepath.Join(sockDir, "api.sock"),
		bin:          bin,
		serverSocket: filepath.Join(dir, "server", "api.sock"),
	}
	port := FreePort(t)
	s.startServer(t, dir, port)
	token := s.joinToken(t)
	for _, e := range opts.Entries {
		s.CreateEntry(t, e)
	}
	s.startAgent(t, dir, port, token)
	return s
}

// spireServerConf is the SPIRE server's configuration, with its port, API
// socket, trust domain, data folder and datastore file: keys in memory,
// an SQLite datastore, agents attested by join tokens.
const spireServerConf = `server {
    bind_address = "127.0.0.1"
    bind_port = "%d"
    socket_path = %q
    trust_domain = %q
    data_dir = %q
    log_level = "INFO"
    ca_key_type = "ec-p256"
    ca_ttl = "24h"
    default_x509_svid_ttl = "1h"
    agent_ttl = "1h"
}

plugins {
    DataStore "sql" {
        plugin_data {
            database_type = "sqlite3"
            connection_string = %q
        }
    }
    NodeAttestor "join_token" {
        plugin_data {}
    }
    KeyManager "memory" {
        plugin_data {}
    }
}
`

// spireAgentConf is the SPIRE agent's configuration, with the server's
// port, the Workload API's socket, the trust domain, the server's bundle,
// its data folder and its join token: keys in memory, workloads attested
// by their Unix process.
const spireAgentConf = `agent {
    server_address = "127.0.0.1"
    server_port = "%d"
    socket_path = %q
    trust_domain = %q
    trust_bundle_path = %q
    data_dir = %q
    join_token = %q
    log_level = "INFO"
}

plugins {
    NodeAttestor "join_token" {
        plugin_data {}
    }
    KeyManager "memory" {
        plugin_data {}
    }
    WorkloadAttestor "unix" {
        plugin_data {}
    }
}
`

// startServer starts the SPIRE server, listening on port with its files
// in dir, and waits until it is healthy.
func (s *SPIRE) startServer(t T, dir string, port int) {
	t.Helper()
	serverConf := filepath.Join(dir, "server.conf")
	must(t, os.WriteFile(serverConf, []byte(fmt.Sprintf(spireServerConf, port, s.serverSocket, s.TrustDomain.Name(), filepath.Join(dir, "server", "data"),
		filepath.Join(dir, "server", "datastore.sqlite3"))), 0o600))
	s.Server = StartCommand(t, "spire-server", []string{filepath.Join(s.bin, "spire-server"), "run", "-config", serverConf})
	s.waitHealthy(t, s.Server, []string{filepath.Join(s.bin, "spire-server"), "healthcheck", "-socketPath", s.serverSocket})
}

// joinToken has the server generate a join token for the agent, and sets
// AgentID, the SPIFFE ID the agent gets with it.
func (s *SPIRE) joinToken(t T) string {
	t.Helper()
	var token struct {
		Value string `json:"value"`
	}
	must(t, json.Unmarshal(s.ServerCLI(t, "token", "generate", "-ttl", "600", "-output", "json"), &token))
	if token.Value == "" {
		t.Fatal("spire-server token generate gave no token")
	}
	s.AgentID = spiffeid.RequireFromPath(s.TrustDomain, "/spire/agent/join_token/"+token.Value)
	return token.Value
}

// startAgent starts the SPIRE agent, trusting the server's bundle and
// attesting with token, with its files in dir, and waits until it is
// healthy.
func (s *SPIRE) startAgent(t T, dir string, port int, token string) {
	t.Helper()
	sockDir := filepath.Join(dir, "workload")
	bundle := filepath.Join(dir, "bundle.pem")
	must(t, os.WriteFile(bundle, s.ServerCLI(t, "bundle", "show", "-format", "pem"), 0o600))
	agentConf := filepath.Join(dir, "agent.conf")
	must(t, os.WriteFile(agentConf, []byte(fmt.Sprintf(spireAgentConf,
		port, filepath.Join(sockDir, "api.sock"), s.TrustDomain.Name(), bundle, filepath.Join(dir, "agent", "data"), token)), 0o600))
	s.Agent = StartCommand(t, "spire-agent", []string{filepath.Join(s.bin, "spire-agent"), "run", "-config", agentConf})
	s.waitHealthy(t, s.Agent, []string{filepath.Join(s.bin, "spire-agent"), "healthcheck", "-socketPath", filepath.Join(sockDir, "api.sock")})
}

// waitHealthy runs a healthcheck command until it passes (30s at most).
func (s *SPIRE) waitHealthy(t T, c *Command, check []string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := exec.Command(check[0], check[1:]...).CombinedOutput()
		if err == nil {
			return
		}
		select {
		case <-c.Done():
			t.Fatalf("%s exited (%v):\n%s", c.Name, c.Err(), c.Output())
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not healthy within 30s: %v %s\n%s", c.Name, err, out, c.Output())
		}
	}
}

// ServerCLI runs spire-server with args against this server's API socket
// and returns its standard output.
func (s *SPIRE) ServerCLI(t T, args ...string) []byte {
	t.Helper()
	// The socket flag belongs to the subcommand: after all words that
	// name it (e.g. "entry create").
	i := 0
	for i < len(args) && !strings.HasPrefix(args[i], "-") {
		i++
	}
	argv := append(append(append([]string{}, args[:i]...), "-socketPath", s.serverSocket), args[i:]...)
	cmd := exec.Command(filepath.Join(s.bin, "spire-server"), argv...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("spire-server %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr.String())
	}
	return out
}

// CreateEntry registers a workload under the agent and returns the entry ID.
func (s *SPIRE) CreateEntry(t T, e SPIREEntry) string {
	t.Helper()
	args := []string{"entry", "create", "-parentID", s.AgentID.String(), "-spiffeID", e.SPIFFEID.String(), "-output", "json"}
	for _, sel := range e.Selectors {
		args = append(args, "-selector", sel)
	}
	if e.X509SVIDTTL > 0 {
		args = append(args, "-x509SVIDTTL", strconv.Itoa(int(e.X509SVIDTTL.Seconds())))
	}
	for _, dns := range e.DNSNames {
		args = append(args, "-dns", dns)
	}
	var out struct {
		Results []struct {
			Status struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			} `json:"status"`
			Entry struct {
				ID string `json:"id"`
			} `json:"entry"`
		} `json:"results"`
	}
	raw := s.ServerCLI(t, args...)
	if err := json.Unmarshal(raw, &out); err != nil || len(out.Results) != 1 {
		t.Fatalf("spire-server entry create: unexpected output %s (%v)", raw, err)
	}
	if r := out.Results[0]; r.Status.Code != 0 || r.Entry.ID == "" {
		t.Fatalf("spire-server entry create %s: %s", e.SPIFFEID, raw)
	}
	return out.Results[0].Entry.ID
}

// ClientOption points a Workload API client at this agent.
func (s *SPIRE) ClientOption() workloadapi.ClientOption {
	return workloadapi.WithAddr(s.WorkloadAPI)
}

// WaitForSVID polls the Workload API, as the test process, until it hands
// out an SVID for id, and returns it. The agent's first entry sync takes
// several seconds; the wait is capped at timeout.
func (s *SPIRE) WaitForSVID(t T, id spiffeid.ID, timeout time.Duration) *x509svid.SVID {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var last error
	for {
		attempt, cancelAttempt := context.WithTimeout(ctx, 5*time.Second)
		svids, err := workloadapi.FetchX509SVIDs(attempt, s.ClientOption())
		cancelAttempt()
		for _, svid := range svids {
			if svid.ID == id {
				return svid
			}
		}
		if err == nil {
			err = fmt.Errorf("got SVIDs %v, not %s", svidIDs(svids), id)
		}
		last = err
		select {
		case <-ctx.Done():
			t.Fatalf("no SVID for %s from the Workload API within %v: %v", id, timeout, last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// X509Source follows this process's SVID through the Workload API until the
// test ends. It waits for the first SVID up to timeout.
func (s *SPIRE) X509Source(t T, timeout time.Duration) *workloadapi.X509Source {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	src, err := workloadapi.NewX509Source(ctx, workloadapi.WithClientOptions(s.ClientOption()))
	if err != nil {
		t.Fatalf("X.509 source from %s: %v", s.WorkloadAPI, err)
	}
	t.Cleanup(func() { src.Close() })
	return src
}

func svidIDs(svids []*x509svid.SVID) []string {
	var ids []string
	for _, s := range svids {
		ids = append(ids, s.ID.String())
	}
	return ids
}

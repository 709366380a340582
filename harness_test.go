package caddyktls

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/freeport"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// The shared test harness of this package: the in-process forwarder
// (sandboxEnv: a layer4 server with `ktls` then `sandbox`), free ports and
// the admin API. Feature tests live in their own files (sandbox_*_test.go,
// listenerwrapper_*_test.go, ...); every helper used by more than one of
// them lives in a harness_*_test.go file: process (the real binary),
// traffic (gateways, upstreams, transfers and how they end), metrics
// (Prometheus, tls_stat and the registry), modules (test-only Caddy modules
// and `caddy adapt`), listenerwrapper (the HTTPS site behind the wrapper).

// sandboxEnv is a running in-process Caddy with a layer4 server that
// terminates mutual TLS with `ktls` and carries tunnels with `sandbox`.
type sandboxEnv struct {
	ca        *testpki.CA
	client    *testpki.Leaf
	gw        *forwardtest.Gateway
	addr      string // the layer4 listener
	adminAddr string
	cfg       map[string]any
	logFile   string
}

func loopbackAddr(t testing.TB) string {
	t.Helper()
	return freeAddr(t, "127.0.0.1")
}

// freeAddr returns an ip:port where nothing listens, outside the ephemeral
// range, with a port no earlier call in this process returned
// (internal/freeport). Caddy binds its listeners with SO_REUSEPORT, so two
// of them given one port would both bind and the kernel would spread
// connections over the two: a CI run had a tunnel's ClientHello answered
// by the admin server's HTTP 400 ("first record does not look like a TLS
// handshake"). And a port of the ephemeral range, free when probed, can be
// a connection's local port by the time it is used: a target's then
// answers, and a dial from it to itself connects.
func freeAddr(t testing.TB, ip string) string {
	t.Helper()
	a, err := freeport.Addr(netip.MustParseAddr(ip))
	if err != nil {
		t.Fatal(err)
	}
	return a.String()
}

// newSandboxEnv starts Caddy; sandboxOpts are merged into the sandbox
// handler's JSON.
func newSandboxEnv(t testing.TB, sandboxOpts map[string]any) *sandboxEnv {
	t.Helper()
	e := newSandboxConfig(t, sandboxOpts)
	e.start(t)
	return e
}

// start loads e.cfg into this process's Caddy and unloads it at cleanup.
func (e *sandboxEnv) start(t testing.TB) {
	t.Helper()
	e.load(t)
	t.Cleanup(func() {
		// caddy.Stop leaves the admin server running; a config with admin
		// disabled stops it, and stops the apps too.
		if err := caddy.Load([]byte(unloadConfig), true); err != nil {
			t.Errorf("unload: %v", err)
		}
	})
}

// The sandboxEnv gateway's signing key ID and its client certificate's
// subject, as the forwarder attributes tunnels.
const (
	gatewayKeyID   = "gw-1"
	gatewaySubject = "CN=gateway-1"
)

// newSandboxConfig builds the configuration of a sandboxEnv without
// loading it.
func newSandboxConfig(t testing.TB, sandboxOpts map[string]any) *sandboxEnv {
	t.Helper()
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	e := &sandboxEnv{ca: testpki.NewCA(t, "test CA"), gw: forwardtest.NewGateway(t, gatewayKeyID),
		addr: loopbackAddr(t), adminAddr: loopbackAddr(t), logFile: filepath.Join(t.TempDir(), "caddy.log")}
	e.client = e.ca.Client(t, "gateway-1") // gatewaySubject
	server := e.ca.Server(t)
	sandbox := map[string]any{
		"handler":     "sandbox",
		"keys":        []any{map[string]any{"id": gatewayKeyID, "public_key": base64.StdEncoding.EncodeToString(e.gw.Pub)}},
		"allow_cidrs": []string{"127.0.0.0/8"},
	}
	for k, v := range sandboxOpts {
		sandbox[k] = v
	}
	e.cfg = map[string]any{
		"admin": map[string]any{"listen": e.adminAddr, "config": map[string]any{"persist": false}},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{
			"level":   "INFO",
			"writer":  map[string]any{"output": "file", "filename": e.logFile, "roll": false},
			"encoder": map[string]any{"format": "json"},
		}}},
		"apps": map[string]any{
			"tls": map[string]any{
				"certificates": map[string]any{"load_pem": []any{
					map[string]any{"certificate": string(server.CertPEM), "key": string(server.KeyPEM)},
				}},
				// A reload would start storage cleaning, whose lock file
				// goroutine lives 5s: long enough to look like a leak.
				"disable_storage_clean": true,
			},
			"layer4": map[string]any{"servers": map[string]any{"tunnels": map[string]any{
				"listen": []string{e.addr},
				"routes": []any{map[string]any{"handle": []any{
					map[string]any{
						"handler": "ktls",
						// A liveness bound: a loaded VM takes longer than the
						// 10 s default for dozens of concurrent handshakes, and
						// a session cut in its handshake never reaches the
						// sandbox handler whose behaviour the tests count.
						"handshake_timeout": "2m",
						"connection_policies": []any{map[string]any{
							"default_sni": "localhost",
							"client_authentication": map[string]any{
								"mode":             "require_and_verify",
								"trusted_ca_certs": []string{base64.StdEncoding.EncodeToString(e.ca.Cert.Raw)},
								"verifiers": []any{map[string]any{
									"verifier":           "leaf",
									"leaf_certs_loaders": []any{map[string]any{"loader": "pem", "certificates": []string{string(e.client.CertPEM)}}},
								}},
							},
						}},
					},
					sandbox,
				}}},
			}}},
		},
	}
	return e
}

// route returns the layer4 server's route, whose handle list is ktls then
// sandbox.
func (e *sandboxEnv) route() map[string]any {
	return e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)["tunnels"].(map[string]any)["routes"].([]any)[0].(map[string]any)
}

// sandboxHandler returns the sandbox handler's JSON in e.cfg.
func (e *sandboxEnv) sandboxHandler() map[string]any {
	return e.route()["handle"].([]any)[1].(map[string]any)
}

func (e *sandboxEnv) load(t testing.TB) {
	t.Helper()
	raw, err := json.Marshal(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(raw, true); err != nil {
		t.Fatalf("caddy.Load: %v", err)
	}
}

// postLoad POSTs e.cfg to the admin API's /load, as an operator reloads
// the configuration.
func (e *sandboxEnv) postLoad(t testing.TB) {
	t.Helper()
	body, err := json.Marshal(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopped := len(e.logLines(t, "stopped previous server"))
	// No keep-alive: an idle admin connection would count as a leak.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Post("http://"+e.adminAddr+"/load", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatalf("POST /load: %v", err)
	}
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /load: %s: %s", resp.Status, msg)
	}
	// Every load replaces the admin server and stops the old one in the
	// background; until then its SO_REUSEPORT socket still takes a share of
	// new connections, and one that lands there as the shutdown begins is
	// closed unanswered (the next POST fails with EOF, seen at 1000 tunnels
	// on 2 loaded cores). Caddy logs the stop.
	waitUntil(t, 30*time.Second, func() bool { return len(e.logLines(t, "stopped previous server")) > stopped },
		"the admin server this load replaced to stop")
}

func (e *sandboxEnv) tlsConfig(leaf *testpki.Leaf) *tls.Config {
	cfg := &tls.Config{RootCAs: e.ca.Pool, ServerName: "localhost", MinVersion: tls.VersionTLS13}
	if leaf != nil {
		cfg.Certificates = []tls.Certificate{leaf.TLS}
	}
	return cfg
}

// dial opens a tunnel to target with a bound, signed preamble.
func (e *sandboxEnv) dial(t testing.TB, sandbox string, target netip.AddrPort) *ktls.Conn {
	t.Helper()
	return e.dialWith(t, e.tlsConfig(e.client), e.gw.Signer, sandbox, target)
}

// dialWith is dial with the gateway's TLS configuration cfg and a preamble
// signed by signer.
func (e *sandboxEnv) dialWith(t testing.TB, cfg *tls.Config, signer *preamble.Signer, sandbox string, target netip.AddrPort) *ktls.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := gatewayDial(ctx, e.addr, cfg, signer, sandbox, target)
	if err != nil {
		t.Fatalf("gateway dial: %v", err)
	}
	return c
}

// tlsSend dials addr with crypto/tls and writes a preamble for claims
// with preamble.Send: a peer that is no gateway, such as one without a
// client certificate (which gateway.New refuses).
func tlsSend(ctx context.Context, addr string, cfg *tls.Config, signer *preamble.Signer, claims preamble.Claims) (*tls.Conn, error) {
	nc, err := (&tls.Dialer{Config: cfg}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	c := nc.(*tls.Conn)
	if err := preamble.Send(ctx, c, signer, claims); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// gatewayDial opens a tunnel to the forwarder at addr as a gateway does
// (gateway.Dialer), in userspace TLS, as an outside client of the
// forwarder would: its client certificate from cfg, a preamble for
// sandbox and target signed by signer and bound to the session. It
// resumes a session only from cfg's ClientSessionCache. Every error is a
// *gateway.DialError.
func gatewayDial(ctx context.Context, addr string, cfg *tls.Config, signer *preamble.Signer, sandbox string, target netip.AddrPort) (*ktls.Conn, error) {
	return gatewayDialWith(ctx, addr, cfg, signer, sandbox, target, ktls.Options{Disable: true})
}

// gatewayDialWith is gatewayDial with the gateway's session on opts (the
// zero Options: kernel TLS where the kernel has it).
func gatewayDialWith(ctx context.Context, addr string, cfg *tls.Config, signer *preamble.Signer, sandbox string, target netip.AddrPort, opts ktls.Options) (*ktls.Conn, error) {
	gc := gateway.Config{TLS: cfg, Signer: signer, KTLS: opts}
	if deadline, ok := ctx.Deadline(); ok {
		gc.DialTimeout = time.Until(deadline) // ctx's bound, not the default 10 s
	}
	d, err := gateway.New(gc)
	if err != nil {
		return nil, err
	}
	return d.Dial(ctx, gateway.Route{Forwarder: addr, Sandbox: sandbox, Target: target})
}

func (e *sandboxEnv) adminGet(t testing.TB, path string, v any) {
	t.Helper()
	if err := json.Unmarshal(e.adminBody(t, path), v); err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
}

// adminBody GETs path from the admin endpoint.
func (e *sandboxEnv) adminBody(t testing.TB, path string) []byte {
	t.Helper()
	return adminGet(t, e.adminAddr, path)
}

// adminGet GETs path from the admin endpoint at adminAddr and fails t
// unless it answers 200.
func adminGet(t testing.TB, adminAddr, path string) []byte {
	t.Helper()
	// No keep-alive: an idle admin connection would count as a leak.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get("http://" + adminAddr + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s (%v): %s", path, resp.Status, err, b)
	}
	return b
}

// unloadConfig stops the admin server (caddy.Stop leaves it running), the
// apps, and the file log writer (not rolled: a roller goroutine would outlive it).
const unloadConfig = `{"admin":{"disabled":true,"config":{"persist":false}},` +
	`"logging":{"logs":{"default":{"writer":{"output":"discard"}}}}}`

// logLines returns the JSON log entries whose message is msg.
func (e *sandboxEnv) logLines(t testing.TB, msg string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(e.logFile)
	if err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	for line := range strings.Lines(string(data)) {
		var m map[string]any
		if json.Unmarshal([]byte(line), &m) == nil && m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

// waitLogLine waits until the log holds more than n entries whose message
// is msg and returns entry n (counted from 0): the first logged after the
// n that were there.
func (e *sandboxEnv) waitLogLine(t testing.TB, msg string, n int) map[string]any {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if lines := e.logLines(t, msg); len(lines) > n {
			return lines[n]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log line %q after the %d there were", msg, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

const rejectedMsg = "sandbox tunnel rejected"

// waitUntil polls cond until it holds, or fails t after timeout naming what
// it waited for.
func waitUntil(t testing.TB, timeout time.Duration, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

var sandboxSeq atomic.Int64

// uniqueSandbox returns a sandbox ID no other tunnel of this process has
// used, so that per-sandbox counters and events of the process-level
// registry start from zero even with -count.
func uniqueSandbox(prefix string) string {
	return fmt.Sprintf("%s-%d", prefix, sandboxSeq.Add(1))
}

// freeAddr never hands out a port twice: 500 bare probes of ~14,000
// ephemeral ports would repeat one about nine times.
func TestFreeAddrNeverRepeats(t *testing.T) {
	seen := map[string]bool{}
	for range 500 {
		addr := freeAddr(t, "127.0.0.1")
		if seen[addr] {
			t.Fatalf("freeAddr returned %s twice", addr)
		}
		seen[addr] = true
	}
}

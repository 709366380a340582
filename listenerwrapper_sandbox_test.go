package caddyktls

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// TestListenerWrapperSandboxShape runs examples/http-forwarder.Caddyfile,
// the forwarder shape: an HTTPS server with client authentication whose
// listener wrappers are `ktls` and then `layer4`, routing sandbox preambles
// to the sandbox handler. A tunnel and HTTPS requests (HTTP/1.1 and HTTP/2)
// share the port; on this kernel both run on userspace TLS. Caddy logs no
// connectionStater WARN: ktls_session records the session for HTTP.
func TestListenerWrapperSandboxShape(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperSandboxShape covers this kernel")
	}
	lwSandboxShape(t, false)
}

// TestKernelListenerWrapperSandboxShape: the same on a kTLS kernel, where the
// tunnel must be spliced both ways.
func TestKernelListenerWrapperSandboxShape(t *testing.T) {
	kerneltest.Require(t)
	lwSandboxShape(t, true)
}

// TestListenerWrapperSandboxShapeNeedsSession is why the example routes
// through ktls_session first: without it caddy-l4 hands HTTP connections
// that do not report their TLS state, and Caddy logs its WARN for every one
// (requests still see r.TLS, through the wrapper's connection context).
// The wrapper warns about the missing route once, at provision.
func TestListenerWrapperSandboxShapeNeedsSession(t *testing.T) {
	if forwardtest.RaceEnabled {
		t.Skip("race detector on: without ktls_session, HTTP through caddy-l4 v0.1.2's listener wrapper races with caddy-l4's own connection bookkeeping (layer4/listener.go)")
	}
	f := lwStartForwarder(t, netip.MustParseAddrPort("127.0.0.1:9"), false)
	// The wrapper says so once, when the configuration loads.
	if n := len(jsonLogLines(t, f.logFile, layer4WithoutSessionWarning)); n != 1 {
		t.Errorf("%d provision warnings about the missing ktls_session, want 1", n)
	}
	conns := f.checkHTTPS(t)
	if warns := len(jsonLogLines(t, f.logFile, lwStaterWarning)); warns != conns {
		t.Errorf("%d connectionStater WARN lines for %d HTTPS connections without ktls_session, want one each: have Caddy or caddy-l4 changed?", warns, conns)
	}
}

// TestListenerWrapperSandboxUpstreamReset: a tunnel whose sandbox resets
// its connection ends as a failure at the gateway on this route too
// (httpConn.Abort), after every byte the sandbox answered.
func TestListenerWrapperSandboxUpstreamReset(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperSandboxUpstreamReset covers this kernel")
	}
	lwSandboxUpstreamReset(t, false)
}

// TestKernelListenerWrapperSandboxUpstreamReset: the same on a kTLS kernel,
// where the failure is the internal_error alert.
func TestKernelListenerWrapperSandboxUpstreamReset(t *testing.T) {
	kerneltest.Require(t)
	lwSandboxUpstreamReset(t, true)
}

func lwSandboxUpstreamReset(t *testing.T, kernel bool) {
	target, upReceived := resetUpstream(t, resetAnswer, resetRequest)
	f := lwStartForwarder(t, target, true)
	forwardtest.CheckLeaks(t)
	checkAnswerThenFailure(t, f.dial(t, f.gw.Signer, "sbx-http-rst", target), kernel, upReceived)
}

// lwForwarder is examples/http-forwarder.Caddyfile loaded into this
// process, with its files and ports from the environment it reads.
type lwForwarder struct {
	addr, logFile string
	clientTLS     *tls.Config
	gw            *forwardtest.Gateway
	site          *lwSite // for its HTTP clients
}

// lwStartForwarder writes the example's files (PKI, gateway keyring),
// adapts it for a sandbox target at target, logs to a JSON file and loads
// it; without session, the layer4 routes lose their ktls_session route.
func lwStartForwarder(t *testing.T, target netip.AddrPort, session bool) *lwForwarder {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	ca := testpki.NewCA(t, "forwarder CA")
	server, client := ca.Server(t), ca.Client(t, "gateway-9")
	gw := forwardtest.NewGateway(t, "gw-9")
	keyring, err := preamble.MarshalPublicKey("gw-9", gw.Pub)
	if err != nil {
		t.Fatal(err)
	}
	for name, data := range map[string][]byte{"forwarder.pem": server.CertPEM, "forwarder-key.pem": server.KeyPEM,
		"ca.pem": ca.PEM, "gateway.pem": client.CertPEM, "gateways.pem": keyring} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	port := loopbackPort(t)
	for k, v := range map[string]string{"FWD_DIR": dir, "FWD_PORT": strconv.Itoa(port),
		"FWD_ALLOW": target.Addr().String(), "FWD_ALLOW_PORTS": strconv.Itoa(int(target.Port()))} {
		t.Setenv(k, v)
	}
	example, err := os.ReadFile("examples/http-forwarder.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	adapted, err := adaptCaddyfile(t, string(example))
	if err != nil {
		t.Fatalf("adapt the example: %v", err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(adapted, &cfg); err != nil {
		t.Fatal(err)
	}
	f := &lwForwarder{addr: fmt.Sprintf("127.0.0.1:%d", port), logFile: filepath.Join(dir, "caddy.log"), gw: gw,
		clientTLS: &tls.Config{RootCAs: ca.Pool, ServerName: "localhost", Certificates: []tls.Certificate{client.TLS}},
		site:      &lwSite{port: port}}
	cfg["admin"] = map[string]any{"disabled": true, "config": map[string]any{"persist": false}}
	// Caddy's default storage path is fixed at init, before t.Setenv.
	cfg["storage"] = map[string]any{"module": "file_system", "root": filepath.Join(dir, "storage")}
	cfg["logging"] = map[string]any{"logs": map[string]any{"default": map[string]any{
		"level":   "INFO",
		"writer":  map[string]any{"output": "file", "filename": f.logFile, "roll": false},
		"encoder": map[string]any{"format": "json"},
	}}}
	if !session {
		layer4 := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["srv0"].(map[string]any)["listener_wrappers"].([]any)[1].(map[string]any)
		routes := layer4["routes"].([]any)
		if h := routes[0].(map[string]any)["handle"].([]any)[0].(map[string]any)["handler"]; h != "ktls_session" {
			t.Fatalf("the example's first layer4 route handles with %v, not ktls_session", h)
		}
		layer4["routes"] = routes[1:]
	}
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(raw, true); err != nil {
		t.Fatalf("load the example: %v", err)
	}
	t.Cleanup(func() {
		if err := caddy.Load([]byte(unloadConfig), true); err != nil {
			t.Errorf("unload: %v", err)
		}
	})
	return f
}

// dial opens a tunnel to target for sandbox with a preamble signer signed
// and bound to the session.
func (f *lwForwarder) dial(t *testing.T, signer *preamble.Signer, sandbox string, target netip.AddrPort) *ktls.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := gatewayDial(ctx, f.addr, f.clientTLS, signer, sandbox, target)
	if err != nil {
		t.Fatalf("gateway dial: %v", err)
	}
	return c
}

// checkHTTPS sends an HTTP/1.1 and an HTTP/2 request over new connections
// through layer4 to the site, checks that both see the TLS session, and
// returns the number of connections.
func (f *lwForwarder) checkHTTPS(t *testing.T) (conns int) {
	t.Helper()
	for major, client := range map[int]*http.Client{1: f.site.h1(f.clientTLS), 2: f.site.h2(f.clientTLS)} {
		body := string(lwGet(t, client, f.site.url("localhost", "/"), major))
		client.CloseIdleConnections()
		conns++
		if want := "forwarder up (tls1.3, client CN=gateway-9)"; body != want {
			t.Errorf("HTTP/%d through layer4: %q, want %q", major, body, want)
		}
	}
	return conns
}

func lwSandboxShape(t *testing.T, kernel bool) {
	size := forwardtest.TransferMiB(t, int64(lwTestMiB(t))) << 20
	up := forwardtest.NewUpstream(t, size+3)
	f := lwStartForwarder(t, up.Addr(), true)
	// After Caddy started: what Caddy itself keeps (its log file) is not a
	// leak; everything the tunnel and the requests open must be gone again.
	forwardtest.CheckLeaks(t)

	// The tunnel: a preamble bound to this TLS session, then data both ways.
	conn := f.dial(t, f.gw.Signer, "sbx-http", up.Addr())
	dp0 := forwarder.Tunnels().DataPath()
	n, recvSum, err := transfer(conn, size, 11)
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	checkTunnelTransfer(t, up, size, 11, n, recvSum)

	// Which data path moved the tunnel's bytes: splice on kTLS, else copy.
	// The bytes layer4 read ahead while matching the preamble (at most its
	// prefetch, flushed to the sandbox first) are counted by neither.
	dp := forwarder.Tunnels().DataPath()
	spliced, copied := dp.SpliceBytes-dp0.SpliceBytes, dp.CopyBytes-dp0.CopyBytes
	moved, prefetch := 2*size+3, int64(64<<10)
	if kernel && (spliced < moved-prefetch || spliced > moved || copied != 0) {
		t.Errorf("kTLS tunnel: %d bytes spliced, %d copied; want all %d (less a prefetch) spliced", spliced, copied, moved)
	}
	if !kernel && (copied < moved-prefetch || copied > moved || spliced != 0) {
		t.Errorf("userspace TLS tunnel: %d bytes copied, %d spliced; want all %d (less a prefetch) copied", copied, spliced, moved)
	}

	// A refused tunnel (signed with another key under the gateway's key
	// ID) ends as refused on this route too (httpConn.Refuse).
	refused := f.dial(t, forwardtest.NewGateway(t, "gw-9").Signer, "sbx-http-refused", up.Addr())
	refused.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, refused); n != 0 {
		t.Errorf("the refused tunnel read %d bytes (err %v); want none", n, err)
	} else {
		checkGatewayEnd(t, err, kernel, true)
	}
	refused.Close()
	// It is attributed to the gateway's certificate here too (the session
	// comes from the wrapped connection, not from caddy-l4).
	var rejected []map[string]any
	for deadline := time.Now().Add(5 * time.Second); len(rejected) == 0 && time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		rejected = jsonLogLines(t, f.logFile, "sandbox tunnel rejected")
	}
	if len(rejected) != 1 || rejected[0]["reason"] != "bad-signature" || rejected[0]["client_certificate"] != "CN=gateway-9" {
		t.Errorf("rejections logged %v, want one bad-signature from CN=gateway-9", rejected)
	}

	// HTTPS on the same port falls through layer4 to the HTTP server, and
	// the requests still see the TLS session; Caddy logs no WARN for them.
	f.checkHTTPS(t)
	if warns := jsonLogLines(t, f.logFile, lwStaterWarning); len(warns) != 0 {
		t.Errorf("Caddy logged %d connectionStater WARN lines through ktls_session: %v", len(warns), warns)
	}
	if n := len(jsonLogLines(t, f.logFile, layer4WithoutSessionWarning)); n != 0 {
		t.Errorf("%d provision warnings about a missing ktls_session, although the example has the route", n)
	}
	if n := len(jsonLogLines(t, f.logFile, "server running")); n != 1 {
		t.Errorf("%d \"server running\" lines in the log: is it the right log?", n)
	}
}

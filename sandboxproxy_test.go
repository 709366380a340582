package caddyktls

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/edgegateway"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// gatewayEnv is a sandboxEnv (the forwarder) plus, in the same Caddy, an
// edge gateway: a layer4 server that terminates the user's TLS with `ktls`
// and opens tunnels to the forwarder with `sandbox_proxy`, its sandbox ID
// taken from the user's server name (<sandbox>.sandbox.test).
type gatewayEnv struct {
	*sandboxEnv
	gwAddr string
	files  gatewayFiles
}

// gatewayFiles are what a gateway module loads: its client certificate
// and key, the forwarders' CA, its signing key (with its Key-Id).
type gatewayFiles struct {
	cert, key, ca, signingKey string
	keyID                     string
	pub                       ed25519.PublicKey
}

// gatewayKeyIDEdge is the edge gateway's signing key ID in these tests.
const gatewayKeyIDEdge = "edge-1"

func writeGatewayFiles(t testing.TB, ca *testpki.CA, client *testpki.Leaf) gatewayFiles {
	t.Helper()
	dir := t.TempDir()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	pemKey, err := preamble.MarshalSigningKey(gatewayKeyIDEdge, priv)
	if err != nil {
		t.Fatal(err)
	}
	f := gatewayFiles{cert: filepath.Join(dir, "gw.crt"), key: filepath.Join(dir, "gw.key"), ca: ca.WriteFile(t, dir, "ca.pem"),
		signingKey: filepath.Join(dir, "preamble.key"), keyID: gatewayKeyIDEdge, pub: pub}
	for path, data := range map[string][]byte{f.cert: client.CertPEM, f.key: client.KeyPEM, f.signingKey: pemKey} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// addGatewaySide prepares e's configuration for an edge gateway in the
// same Caddy: the gateway's files (its client certificate is e's trusted
// gateway certificate), its signing key in the forwarder's keys, and a
// certificate for users' *.sandbox.test in the tls app.
func addGatewaySide(t *testing.T, e *sandboxEnv) gatewayFiles {
	t.Helper()
	files := writeGatewayFiles(t, e.ca, e.client)
	sh := e.sandboxHandler()
	sh["keys"] = append(sh["keys"].([]any), map[string]any{"id": files.keyID, "public_key": base64.StdEncoding.EncodeToString(files.pub)})
	site := e.ca.Server(t, "*.sandbox.test")
	certs := e.cfg["apps"].(map[string]any)["tls"].(map[string]any)["certificates"].(map[string]any)
	certs["load_pem"] = append(certs["load_pem"].([]any), map[string]any{"certificate": string(site.CertPEM), "key": string(site.KeyPEM)})
	return files
}

// dialJSON is the edgegateway.DialOptions JSON of files.
func (f gatewayFiles) dialJSON() map[string]any {
	return map[string]any{
		"tls": map[string]any{
			"client_certificate_file": f.cert, "client_certificate_key_file": f.key,
			"ca":          map[string]any{"provider": "file", "pem_files": []string{f.ca}},
			"server_name": "localhost",
		},
		"signing_key_file": f.signingKey,
	}
}

// newGatewayEnv starts the forwarder and the gateway; proxyOpts are merged
// into the sandbox_proxy handler's JSON.
func newGatewayEnv(t *testing.T, proxyOpts map[string]any) *gatewayEnv {
	t.Helper()
	return newGatewayEnvWith(t, proxyOpts)
}

// newGatewayEnvWith is newGatewayEnv with handlers placed between ktls
// and sandbox_proxy.
func newGatewayEnvWith(t *testing.T, proxyOpts map[string]any, before ...any) *gatewayEnv {
	t.Helper()
	return newGatewayEnvFull(t, nil, proxyOpts, before...)
}

// newGatewayEnvFull is newGatewayEnvWith with sandboxOpts merged into the
// forwarder's sandbox handler.
func newGatewayEnvFull(t *testing.T, sandboxOpts, proxyOpts map[string]any, before ...any) *gatewayEnv {
	t.Helper()
	e := &gatewayEnv{sandboxEnv: newSandboxConfig(t, sandboxOpts), gwAddr: loopbackAddr(t)}
	e.files = addGatewaySide(t, e.sandboxEnv)
	proxy := e.files.dialJSON()
	proxy["handler"] = "sandbox_proxy"
	proxy["forwarder"] = e.addr
	proxy["sandbox"] = "{l4.tls.server_name.labels.2}"
	for k, v := range proxyOpts {
		proxy[k] = v
	}
	servers := e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)
	servers["edge"] = map[string]any{
		"listen": []string{e.gwAddr},
		"routes": []any{map[string]any{"handle": append(append([]any{
			map[string]any{"handler": "ktls", "handshake_timeout": "2m"}}, before...),
			proxy,
		)}},
	}
	e.start(t)
	return e
}

// proxyHandler returns the sandbox_proxy handler's JSON in e.cfg.
func (e *gatewayEnv) proxyHandler() map[string]any {
	edge := e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)["edge"].(map[string]any)
	handle := edge["routes"].([]any)[0].(map[string]any)["handle"].([]any)
	return handle[len(handle)-1].(map[string]any)
}

// userDial is a user's TLS session to the gateway for sandbox.
func (e *gatewayEnv) userDial(t *testing.T, sandbox string) *tls.Conn {
	t.Helper()
	c, err := tls.Dial("tcp", e.gwAddr, &tls.Config{RootCAs: e.ca.Pool, ServerName: sandbox + ".sandbox.test"})
	if err != nil {
		t.Fatalf("user dial: %v", err)
	}
	return c
}

// The gateway series.
func gatewayDialsSeries(result string) string {
	return `caddy_ktls_gateway_dials_total{module="layer4.handlers.sandbox_proxy",result="` + result + `"}`
}

func gatewayEndsSeries(end string) string {
	return `caddy_ktls_gateway_tunnel_ends_total{end="` + end + `",module="layer4.handlers.sandbox_proxy"}`
}

// A user's TLS stream goes through the gateway's sandbox_proxy, the
// forwarder and reaches the sandbox exact both ways; the sandbox named by
// the server name; every counter on the way agrees.
func TestSandboxProxyEndToEnd(t *testing.T) { sandboxProxyEndToEnd(t, false) }

// TestKernelSandboxProxyEndToEnd is TestSandboxProxyEndToEnd on kTLS: the
// gateway splices kTLS to kTLS, copying nothing, as the forwarder does.
func TestKernelSandboxProxyEndToEnd(t *testing.T) {
	kerneltest.Require(t)
	sandboxProxyEndToEnd(t, true)
}

func sandboxProxyEndToEnd(t *testing.T, kernel bool) {
	size := forwardtest.TransferMiB(t, 4) << 20
	up := forwardtest.NewUpstream(t, size+3)
	sandbox := uniqueSandbox("sbx-edge")
	e := newGatewayEnv(t, map[string]any{"target": up.Addr().String()})
	waitIdle(t)
	m0 := e.metrics(t)
	var n int64
	var recvSum [32]byte
	var err error
	run := func() { n, recvSum, err = transfer(e.userDial(t, sandbox), size, 7) }
	var delta kerneltest.Stat
	if kernel {
		delta = kerneltest.StatDelta(t, run)
	} else {
		run()
	}
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	checkTunnelTransfer(t, up, size, 7, n, recvSum)
	waitUntil(t, 10*time.Second, func() bool {
		return e.metrics(t)[gatewayEndsSeries("closed")]-m0[gatewayEndsSeries("closed")] == 1
	}, "the gateway to count the tunnel's end")
	m1 := e.metrics(t)
	if d := m1[gatewayDialsSeries("ok")] - m0[gatewayDialsSeries("ok")]; d != 1 {
		t.Errorf("gateway dials ok moved by %d, want 1", d)
	}
	spliced := m1[`caddy_ktls_gateway_relay_bytes_total{path="splice"}`] - m0[`caddy_ktls_gateway_relay_bytes_total{path="splice"}`]
	copied := m1[`caddy_ktls_gateway_relay_bytes_total{path="copy"}`] - m0[`caddy_ktls_gateway_relay_bytes_total{path="copy"}`]
	if spliced+copied != 2*size+3 {
		t.Errorf("gateway relay bytes moved by %d spliced + %d copied, want %d in all", spliced, copied, 2*size+3)
	}
	if kernel {
		if copied != 0 {
			t.Errorf("the gateway copied %d bytes through userspace, want 0 (kTLS to kTLS)", copied)
		}
		// The gateway's two sessions and the forwarder's one (the user's is
		// crypto/tls).
		if delta["TlsTxSw"] < 3 || delta["TlsRxSw"] < 3 {
			t.Errorf("tls_stat delta %v: want at least 3 TX and 3 RX sessions", delta)
		}
	}
}

// A target outside the forwarder's allowlist: the forwarder refuses,
// nothing reaches any sandbox, and the gateway counts and logs the end; the
// refusal reaches the user as access_denied, with kTLS or without.
func TestSandboxProxyRefusal(t *testing.T) { sandboxProxyRefusal(t) }

func TestKernelSandboxProxyRefusal(t *testing.T) {
	kerneltest.Require(t)
	sandboxProxyRefusal(t)
}

func sandboxProxyRefusal(t *testing.T) {
	trap := forwardtest.NewUpstreamOn(t, ":0", 1)
	e := newGatewayEnv(t, map[string]any{"target": "10.255.0.1:" + strconv.Itoa(int(trap.Addr().Port()))})
	m0 := e.metrics(t)
	// The user's bytes are in flight when the refusal comes back (see
	// TestKernelRelayRefusalTravels).
	n, err := userEnded(t, e.userDial(t, uniqueSandbox("sbx-refused")), 256<<10)
	if n != 0 || err == nil {
		t.Fatalf("user read %d bytes, err %v: want none and an error", n, err)
	}
	// With or without kernel TLS the forwarder's refusal is an
	// access_denied alert, and the gateway passes it on.
	want := "refused"
	if !strings.Contains(err.Error(), "access denied") {
		t.Errorf("user's error %v, want access denied", err)
		time.Sleep(time.Second)
		for _, msg := range []string{"sandbox_proxy: tunnel failed", "sandbox tunnel rejected"} {
			for _, l := range e.logLines(t, msg) {
				t.Logf("log: %v", l)
			}
		}
	}
	e.waitLogLine(t, "sandbox_proxy: the forwarder refused the tunnel (its log names the reason); nothing reached the sandbox", 0)
	waitUntil(t, 10*time.Second, func() bool { return e.metrics(t)[gatewayEndsSeries(want)]-m0[gatewayEndsSeries(want)] == 1 },
		"the gateway to count the tunnel's end as "+want)
	if got := e.metrics(t)[`caddy_ktls_sandbox_rejects_total{reason="target-denied"}`] - m0[`caddy_ktls_sandbox_rejects_total{reason="target-denied"}`]; got != 1 {
		t.Errorf("forwarder target-denied rejects moved by %d, want 1", got)
	}
	if trap.Accepted() != 0 {
		t.Errorf("a sandbox was dialed %d times", trap.Accepted())
	}
}

// Placeholders that give no valid route: the connection is refused before
// anything is dialed, counted and logged with the part that is wrong.
func TestSandboxProxyNoRoute(t *testing.T) {
	e := newGatewayEnv(t, map[string]any{"target": "{l4.tls.server_name.labels.9}:80"})
	m0 := e.metrics(t)
	if n, err := userEnded(t, e.userDial(t, "sbx-x"), 0); n != 0 || err == nil {
		t.Errorf("user read %d bytes, err %v: want the connection ended", n, err)
	}
	line := e.waitLogLine(t, "sandbox_proxy: no route for the connection; refused", 0)
	if msg, _ := line["error"].(string); !strings.Contains(msg, `route target ":80"`) {
		t.Errorf("log error %q, want it to name the target", msg)
	}
	if got := e.metrics(t)[gatewayDialsSeries("no-route")] - m0[gatewayDialsSeries("no-route")]; got != 1 {
		t.Errorf("no-route dials moved by %d, want 1", got)
	}
	if got := e.metrics(t)[tunnelsTotalSeries] - m0[tunnelsTotalSeries]; got != 0 {
		t.Errorf("the forwarder opened %d tunnels", got)
	}
}

// Forwarder unreachable: the user's connection is refused, the failed step
// counted and logged.
func TestSandboxProxyForwarderDown(t *testing.T) {
	down := forwardtest.ClosedPort(t).String()
	e := newGatewayEnv(t, map[string]any{"target": "127.0.0.1:9", "forwarder": down})
	m0 := e.metrics(t)
	if n, err := userEnded(t, e.userDial(t, "sbx-x"), 0); n != 0 || err == nil {
		t.Errorf("user read %d bytes, err %v: want the connection ended", n, err)
	}
	e.waitLogLine(t, "sandbox_proxy: cannot open the tunnel; refused, nothing reached the sandbox", 0)
	if got := e.metrics(t)[gatewayDialsSeries("connect")] - m0[gatewayDialsSeries("connect")]; got != 1 {
		t.Errorf("connect failures moved by %d, want 1", got)
	}
}

// A user that leaves (here, a reset) while the gateway dials its forwarder
// gets no tunnel: the gateway sends no preamble, so the forwarder opens
// none and dials no target, and it counts and logs the dial as user-gone,
// not as a failure.
func TestSandboxProxyUserGone(t *testing.T) {
	hold := forwardtest.NewHeldRelay(t)
	e := newGatewayEnv(t, map[string]any{"forwarder": hold.Addr(), "target": "127.0.0.1:9"})
	hold.Target = e.addr
	m0 := e.metrics(t)
	raw, err := net.Dial("tcp", e.gwAddr)
	if err != nil {
		t.Fatal(err)
	}
	c := tls.Client(raw, &tls.Config{RootCAs: e.ca.Pool, ServerName: "sbx-gone.sandbox.test"})
	if err := c.Handshake(); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 10*time.Second, func() bool { return hold.Accepted.Load() == 1 }, "the gateway's dial, held")
	raw.(*net.TCPConn).SetLinger(0)
	raw.Close()
	// The gateway's socket of the user's connection leaves ESTABLISHED.
	local, remote := e.gwAddr, raw.LocalAddr().String()
	waitUntil(t, 10*time.Second, func() bool { return !forwardtest.Established(t, local, remote) }, "the user's reset at the gateway's socket")
	close(hold.Release)
	line := e.waitLogLine(t, "sandbox_proxy: the user left before the tunnel opened; no preamble was sent, nothing reached the sandbox", 0)
	if line["sandbox"] != "sbx-gone" {
		t.Errorf("the log line names sandbox %v, want sbx-gone", line["sandbox"])
	}
	m := e.metrics(t)
	if got := m[gatewayDialsSeries("user-gone")] - m0[gatewayDialsSeries("user-gone")]; got != 1 {
		t.Errorf("user-gone dials moved by %d, want 1", got)
	}
	for _, r := range []string{"ok", "connect", "handshake", "preamble"} {
		if got := m[gatewayDialsSeries(r)] - m0[gatewayDialsSeries(r)]; got != 0 {
			t.Errorf("%s dials moved by %d, want 0", r, got)
		}
	}
	if got := m[tunnelsTotalSeries] - m0[tunnelsTotalSeries]; got != 0 {
		t.Errorf("the forwarder opened %d tunnels", got)
	}
}

// userEnded sends send bytes on c (a write may fail: the gateway may
// have ended c already), then reads until c ends, within 10 s, and checks
// that it did not end in order; it returns what it read and the error c
// ended with.
func userEnded(t *testing.T, c *tls.Conn, send int64) (int64, error) {
	t.Helper()
	defer c.Close()
	if send > 0 {
		io.Copy(c, io.LimitReader(forwardtest.NewPattern(3), send))
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := io.Copy(io.Discard, c)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the user's connection was still open after 10 s")
	}
	if err == nil {
		t.Errorf("the user's connection ended in order (close_notify) after %d bytes: want it refused or failed", n)
		err = io.EOF
	}
	return n, err
}

func TestServerNameLabel(t *testing.T) {
	for _, c := range []struct {
		name, n string
		want    any
		ok      bool
	}{
		{"sbx-1.sandbox.test", "2", "sbx-1", true},
		{"sbx-1.sandbox.test.", "0", "test", true},
		{"sbx-1.sandbox.test", "3", nil, false},
		{"sbx-1.sandbox.test", "-1", nil, false},
		{"sbx-1.sandbox.test", "x", nil, false},
		{"", "0", nil, false},
	} {
		if got, ok := serverNameLabel(c.name, c.n); got != c.want || ok != c.ok {
			t.Errorf("serverNameLabel(%q, %q) = %v, %v; want %v, %v", c.name, c.n, got, ok, c.want, c.ok)
		}
	}
}

var updateGatewayGolden = flag.Bool("update-gateway-golden", false, "rewrite the expected JSON of testdata/caddyfile_adapt/gateway_*.caddytest")

// TestGatewayCaddyfileAdapt checks every
// testdata/caddyfile_adapt/gateway_*.caddytest, which together use every
// option of the gateway modules.
func TestGatewayCaddyfileAdapt(t *testing.T) {
	checkAdaptGolden(t, "testdata/caddyfile_adapt/gateway_*.caddytest", *updateGatewayGolden)
}

// Bad gateway Caddyfile input gets a clear error naming the problem, at
// adapt time or, for what only a loaded module can check, at validation.
func TestSandboxProxyCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ body, want string }{
		{"sandbox_proxy {\n\ttls_client_auth a b c\n}", "tls_client_auth takes a certificate file and its key file"},
		{"sandbox_proxy {\n\tdial_timeout soon\n}", `dial_timeout: "soon" is not a positive duration`},
		{"sandbox_proxy {\n\tforwarder a b\n}", "wrong argument count"},
		{"sandbox_proxy {\n\ttls_trust_pool nonesuch\n}", "nonesuch"},
		{"sandbox_proxy {\n\tfrobnicate\n}", `unknown sandbox_proxy option "frobnicate"`},
		{"sandbox_proxy on", "wrong argument count"},
		{"sandbox_proxy {\n\tresumption maybe\n}", "resumption"},
		{"sandbox_proxy {\n\texpect_no_pad sometimes\n}", "expect_no_pad takes one of on, off"},
		{"sandbox_proxy {\n\tdrain_grace_period later\n}", `drain_grace_period: "later" is not a positive duration`},
		{"sandbox_proxy {\n\tdrain_grace_period 1s 2s\n}", "wrong argument count"},
	} {
		_, err := adaptCaddyfile(t, "{\n\tlayer4 {\n\t\t:9443 {\n\t\t\troute {\n"+tc.body+"\n\t\t\t}\n\t\t}\n\t}\n}\n")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want it to contain %q", tc.body, err, tc.want)
		}
	}
	for _, tc := range []struct {
		name string
		h    edgegateway.Proxy
		want string
	}{
		{"no route", edgegateway.Proxy{}, "forwarder, sandbox and target are required"},
		{"no certificate", edgegateway.Proxy{Forwarder: "f:1", Sandbox: "s", Target: "10.0.0.1:1"}, "no client certificate (tls_client_auth"},
		{"negative drain_grace_period", edgegateway.Proxy{Forwarder: "f:1", Sandbox: "s", Target: "10.0.0.1:1", DrainGracePeriod: caddy.Duration(-time.Second)},
			"sandbox_proxy: drain_grace_period must not be negative (got -1s)"},
		{"insecure", edgegateway.Proxy{Forwarder: "f:1", Sandbox: "s", Target: "10.0.0.1:1", DialOptions: edgegateway.DialOptions{
			TLS: &reverseproxy.TLSConfig{ClientCertificateFile: "c", InsecureSkipVerify: true}}}, "tls_insecure_skip_verify"},
		{"no signing key", edgegateway.Proxy{Forwarder: "f:1", Sandbox: "s", Target: "10.0.0.1:1", DialOptions: edgegateway.DialOptions{
			TLS: &reverseproxy.TLSConfig{ClientCertificateFile: "c"}}}, "no signing_key_file"},
		{"tls_timeout", edgegateway.Proxy{Forwarder: "f:1", Sandbox: "s", Target: "10.0.0.1:1", DialOptions: edgegateway.DialOptions{
			TLS: &reverseproxy.TLSConfig{ClientCertificateFile: "c", HandshakeTimeout: 1}, SigningKeyFile: "k"}}, "use handshake_timeout"},
		{"expect_no_pad both ways", edgegateway.Proxy{Forwarder: "f:1", Sandbox: "s", Target: "10.0.0.1:1", DialOptions: edgegateway.DialOptions{
			TLS: &reverseproxy.TLSConfig{ClientCertificateFile: "c"}, SigningKeyFile: "k", DisableExpectNoPad: true,
			Options: offload.Options{ExpectNoPad: true}}}, "expect_no_pad and disable_expect_no_pad together"},
	} {
		if err := tc.h.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate() = %v, want it to contain %q", tc.name, err, tc.want)
		}
	}
}

// A reload (of the one Caddy that is both gateway and forwarder here)
// leaves an open sandbox_proxy tunnel alone: bytes the user sends after it
// still reach the sandbox, exact.
func TestSandboxProxySurvivesReload(t *testing.T) {
	const half = 256 << 10
	up := forwardtest.NewUpstream(t, 1000)
	e := newGatewayEnv(t, map[string]any{"target": up.Addr().String()})
	c := e.userDial(t, uniqueSandbox("sbx-reload"))
	defer c.Close()
	src := forwardtest.NewPattern(11)
	if _, err := io.CopyN(c, src, half); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 30*time.Second, func() bool { return up.Received() == half }, "the first half to reach the sandbox")
	// A changed configuration, or Caddy would skip the load.
	e.proxyHandler()["dial_timeout"] = "9s"
	e.postLoad(t)
	if _, err := io.CopyN(c, src, half); err != nil {
		t.Fatalf("after the reload: %v", err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	n, err := io.Copy(io.Discard, c)
	if err != nil || n != 1000 {
		t.Errorf("the user read %d bytes, %v; want the sandbox's 1000 and an orderly end", n, err)
	}
	up.Close()
	if r := up.Results()[0]; r.Received != 2*half || r.RecvSum != forwardtest.PatternSum(11, 2*half) {
		t.Errorf("the sandbox received %d bytes (want %d with the user's hash)", r.Received, 2*half)
	}
}

// examples/gateway.Caddyfile (what `make demo` runs as the edge gateway)
// adapts, with the demo's environment, to a layer4 server whose route
// terminates the user's TLS and tunnels by server name, and an HTTPS site
// whose reverse_proxy tunnels with the sandbox transport; both sign with
// the demo's key and present the demo's gateway certificate.
func TestGatewayExampleAdapt(t *testing.T) {
	for k, v := range map[string]string{"GW_DIR": "/demo", "GW_FORWARDER": "127.0.0.1:19443", "GW_TCP_TARGET": "127.0.0.1:19000",
		"GW_APP_TARGET": "127.0.0.1:19001", "GW_TCP": "127.0.0.1:19445", "GW_HTTPS_PORT": "18443", "GW_FORWARDER_NAME": "localhost"} {
		t.Setenv(k, v)
	}
	raw, err := os.ReadFile("examples/gateway.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	out, err := adaptCaddyfile(t, string(raw))
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	dial := `"tls": {"client_certificate_file": "/demo/gateway.pem", "client_certificate_key_file": "/demo/gateway-key.pem",
		"ca": {"provider": "file", "pem_files": ["/demo/ca.pem"]}, "server_name": "localhost"},
		"signing_key_file": "/demo/gateway-signing.pem"`
	for _, want := range []string{
		`{"handler": "sandbox_proxy", "forwarder": "127.0.0.1:19443", "sandbox": "{l4.tls.server_name.labels.2}", "target": "127.0.0.1:19000", ` + dial + `}`,
		`{"protocol": "sandbox", "sandbox": "{http.request.host.labels.2}", "target": "127.0.0.1:19001", ` + dial + `}`,
	} {
		var w any
		if err := json.Unmarshal([]byte(want), &w); err != nil {
			t.Fatal(err)
		}
		if !containsJSON(t, out, w) {
			t.Errorf("examples/gateway.Caddyfile adapts without\n%s\n\n%s", want, out)
		}
	}
}

// containsJSON reports whether the JSON document doc holds a value equal
// to want anywhere.
func containsJSON(t *testing.T, doc []byte, want any) bool {
	var v any
	if err := json.Unmarshal(doc, &v); err != nil {
		t.Fatal(err)
	}
	var walk func(any) bool
	walk = func(x any) bool {
		if reflect.DeepEqual(x, want) {
			return true
		}
		switch x := x.(type) {
		case map[string]any:
			for _, e := range x {
				if walk(e) {
					return true
				}
			}
		case []any:
			for _, e := range x {
				if walk(e) {
					return true
				}
			}
		}
		return false
	}
	return walk(v)
}

// Tunnels to one forwarder resume the first one's TLS session (the
// forwarder's ktls handler issues tickets to the authenticated gateway),
// counted in caddy_ktls_gateway_dials_resumed_total, and move the same
// exact bytes; `resumption off` makes every tunnel a full handshake.
func TestSandboxProxyResumption(t *testing.T) { sandboxProxyResumption(t, false) }

// TestKernelSandboxProxyResumption is TestSandboxProxyResumption on kTLS:
// a resumed tunnel is offloaded and spliced as a full one.
func TestKernelSandboxProxyResumption(t *testing.T) {
	kerneltest.Require(t)
	sandboxProxyResumption(t, true)
}

func sandboxProxyResumption(t *testing.T, kernel bool) {
	const size, tunnels = 256 << 10, 3
	for _, off := range []bool{false, true} {
		t.Run(fmt.Sprintf("resumption off %v", off), func(t *testing.T) {
			up := forwardtest.NewUpstream(t, size+3)
			e := newGatewayEnv(t, map[string]any{"target": up.Addr().String(), "disable_resumption": off})
			waitIdle(t)
			m0 := e.metrics(t)
			for i := range tunnels {
				n, recvSum, err := transfer(e.userDial(t, uniqueSandbox("sbx-resume")), size, uint64(10+i))
				if err != nil {
					t.Fatalf("tunnel %d: %v", i, err)
				}
				if n != size+3 || recvSum != forwardtest.PatternSum(2, size+3) {
					t.Errorf("tunnel %d: the user received %d bytes, want %d with the upstream's hash", i, n, size+3)
				}
			}
			waitUntil(t, 10*time.Second, func() bool {
				return e.metrics(t)[gatewayEndsSeries("closed")]-m0[gatewayEndsSeries("closed")] == tunnels
			}, "the gateway to count the tunnels' ends")
			up.Close()
			// One upstream connection per tunnel, each with its tunnel's
			// bytes (in whatever order they finished).
			want := map[[32]byte]bool{}
			for i := range tunnels {
				want[forwardtest.PatternSum(uint64(10+i), size)] = true
			}
			for i, r := range up.Results() {
				if r.Received != size || !want[r.RecvSum] {
					t.Errorf("upstream connection %d received %d bytes, want %d with a tunnel's hash, once", i, r.Received, size)
				}
				delete(want, r.RecvSum)
			}
			if len(want) != 0 {
				t.Errorf("%d tunnels' bytes never reached the upstream", len(want))
			}
			m1 := e.metrics(t)
			resumed := `caddy_ktls_gateway_dials_resumed_total{module="layer4.handlers.sandbox_proxy"}`
			wantResumed := int64(tunnels - 1)
			if off {
				wantResumed = 0
			}
			if d := m1[gatewayDialsSeries("ok")] - m0[gatewayDialsSeries("ok")]; d != tunnels {
				t.Errorf("gateway dials ok moved by %d, want %d", d, tunnels)
			}
			if d := m1[resumed] - m0[resumed]; d != wantResumed {
				t.Errorf("%s moved by %d, want %d", resumed, d, wantResumed)
			}
			if copied := m1[`caddy_ktls_gateway_relay_bytes_total{path="copy"}`] - m0[`caddy_ktls_gateway_relay_bytes_total{path="copy"}`]; kernel && copied != 0 {
				t.Errorf("the gateway copied %d bytes through userspace, want 0 (resumed sessions are offloaded too)", copied)
			}
		})
	}
}

// A gateway expects no padding from forwarders wherever the kernel allows
// it, unless told otherwise; `expect_no_pad` (bare or on) sets it even
// where the probe says no, `expect_no_pad off` never.
func TestGatewayExpectNoPadOption(t *testing.T) {
	for _, tc := range []struct {
		option         string
		on, off        bool // the JSON fields
		kernel, refuse bool // with and without the kernel's support
	}{
		{"", false, false, true, false},
		{"expect_no_pad", true, false, true, true},
		{"expect_no_pad on", true, false, true, true},
		{"expect_no_pad off", false, true, false, false},
	} {
		out, err := adaptCaddyfile(t, "{\n\tlayer4 {\n\t\t:9443 {\n\t\t\troute {\nsandbox_proxy {\n"+tc.option+"\n}\n\t\t\t}\n\t\t}\n\t}\n}\n")
		if err != nil {
			t.Fatalf("%q: %v", tc.option, err)
		}
		var cfg struct {
			Apps struct {
				Layer4 struct {
					Servers map[string]struct {
						Routes []struct{ Handle []edgegateway.Proxy }
					}
				}
			}
		}
		if err := json.Unmarshal(out, &cfg); err != nil {
			t.Fatal(err)
		}
		g := cfg.Apps.Layer4.Servers["srv0"].Routes[0].Handle[0].DialOptions
		if g.ExpectNoPad != tc.on || g.DisableExpectNoPad != tc.off {
			t.Errorf("%q: expect_no_pad %v, disable_expect_no_pad %v; want %v, %v", tc.option, g.ExpectNoPad, g.DisableExpectNoPad, tc.on, tc.off)
		}
		if got := g.ExpectsNoPad(true); got != tc.kernel {
			t.Errorf("%q on a kernel that accepts it: %v, want %v", tc.option, got, tc.kernel)
		}
		if got := g.ExpectsNoPad(false); got != tc.refuse {
			t.Errorf("%q on a kernel that refuses it: %v, want %v", tc.option, got, tc.refuse)
		}
	}
}

// TestKernelSandboxProxyExpectNoPad: by default the gateway's forwarder
// connection has TLS_RX_EXPECT_NO_PAD in effect, as the kernel reports it;
// with disable_expect_no_pad it has not. Either way the bytes are exact and
// no record was padded (TlsRxNoPadViolation stays 0).
func TestKernelSandboxProxyExpectNoPad(t *testing.T) {
	kerneltest.Require(t)
	if !ktls.Probe().ExpectNoPad {
		t.Fatal("this kernel refuses TLS_RX_EXPECT_NO_PAD; every kernel of the suite (6.1+) accepts it")
	}
	const size = 1 << 20
	for _, off := range []bool{false, true} {
		t.Run(fmt.Sprintf("disable_expect_no_pad %v", off), func(t *testing.T) {
			up := forwardtest.NewUpstream(t, size+3)
			e := newGatewayEnv(t, map[string]any{"target": up.Addr().String(), "disable_expect_no_pad": off})
			// The handshake lines are DEBUG.
			e.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["level"] = "DEBUG"
			e.postLoad(t)
			waitIdle(t)
			var n int64
			var recvSum [32]byte
			var err error
			delta := kerneltest.StatDelta(t, func() { n, recvSum, err = transfer(e.userDial(t, uniqueSandbox("sbx-nopad")), size, 5) })
			if err != nil {
				t.Fatalf("transfer: %v", err)
			}
			checkTunnelTransfer(t, up, size, 5, n, recvSum)
			if delta["TlsRxNoPadViolation"] != 0 || delta["TlsRxSw"] < 3 {
				t.Errorf("tls_stat delta %v: want no padded record and at least 3 RX sessions", delta)
			}
			lines := 0
			for _, l := range e.logLines(t, "kernel TLS handshake") {
				if l["logger"] != "layer4.handlers.sandbox_proxy" {
					continue
				}
				lines++
				if l["rx"] != "sw" || l["rx_no_pad"] != !off {
					t.Errorf("the gateway's forwarder connection: %v; want rx sw, rx_no_pad %v", l, !off)
				}
			}
			if lines != 1 {
				t.Errorf("%d handshake lines of the gateway's forwarder connections, want 1", lines)
			}
		})
	}
}

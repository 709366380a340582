package caddyktls

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "github.com/mholt/caddy-l4"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

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
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// newSandboxEnv starts Caddy; sandboxOpts are merged into the sandbox
// handler's JSON.
func newSandboxEnv(t *testing.T, sandboxOpts map[string]any) *sandboxEnv {
	t.Helper()
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	e := &sandboxEnv{ca: testpki.NewCA(t, "test CA"), gw: forwardtest.NewGateway(t, "gw-1"),
		addr: loopbackAddr(t), adminAddr: loopbackAddr(t), logFile: filepath.Join(t.TempDir(), "caddy.log")}
	e.client = e.ca.Client(t, "gateway-1")
	server := e.ca.Server(t)
	sandbox := map[string]any{
		"handler":     "sandbox",
		"keys":        []any{map[string]any{"id": "gw-1", "public_key": base64.StdEncoding.EncodeToString(e.gw.Pub)}},
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
			"tls": map[string]any{"certificates": map[string]any{"load_pem": []any{
				map[string]any{"certificate": string(server.CertPEM), "key": string(server.KeyPEM)},
			}}},
			"layer4": map[string]any{"servers": map[string]any{"tunnels": map[string]any{
				"listen": []string{e.addr},
				"routes": []any{map[string]any{"handle": []any{
					map[string]any{
						"handler": "ktls",
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
	e.load(t)
	t.Cleanup(func() {
		// caddy.Stop leaves the admin server running; a config with admin
		// disabled stops it, and stops the apps too.
		if err := caddy.Load([]byte(unloadConfig), true); err != nil {
			t.Errorf("unload: %v", err)
		}
	})
	return e
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

func (e *sandboxEnv) tlsConfig(leaf *testpki.Leaf) *tls.Config {
	cfg := &tls.Config{RootCAs: e.ca.Pool, ServerName: "localhost", MinVersion: tls.VersionTLS13}
	if leaf != nil {
		cfg.Certificates = []tls.Certificate{leaf.TLS}
	}
	return cfg
}

// dial opens a tunnel to target with a bound, signed preamble.
func (e *sandboxEnv) dial(t testing.TB, sandbox string, target netip.AddrPort) *tls.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := preamble.Dial(ctx, "tcp", e.addr, e.tlsConfig(e.client), e.gw.Signer, preamble.Claims{SandboxID: sandbox, Target: target})
	if err != nil {
		t.Fatalf("preamble.Dial: %v", err)
	}
	return c
}

// transfer sends `send` pattern bytes (seed) then close_notify, reads to
// EOF, and returns the received count and hash.
func transfer(c *tls.Conn, send int64, seed uint64) (recvN int64, recvSum [32]byte, err error) {
	defer c.Close()
	werr := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, io.LimitReader(forwardtest.NewPattern(seed), send))
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	h := sha256.New()
	recvN, err = io.Copy(h, c)
	copy(recvSum[:], h.Sum(nil))
	if e := <-werr; err == nil {
		err = e
	}
	return recvN, recvSum, err
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
	// No keep-alive: an idle admin connection would count as a leak.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get("http://" + e.adminAddr + path)
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

// checkTunnelTransfer waits for the tunnel to end, closes up and checks
// both directions of a transfer: the upstream received the client's size
// pattern bytes (seed), and the client received the upstream's size+3
// bytes (n, recvSum) unchanged.
func checkTunnelTransfer(t testing.TB, up *forwardtest.Upstream, size int64, seed uint64, n int64, recvSum [32]byte) {
	t.Helper()
	waitIdle(t)
	up.Close()
	r := up.Results()[0]
	if r.Received != size || r.RecvSum != forwardtest.PatternSum(seed, size) {
		t.Errorf("upstream received %d bytes, want %d with the client's hash", r.Received, size)
	}
	if n != size+3 || recvSum != r.SentSum {
		t.Errorf("client received %d bytes, want %d with the upstream's hash", n, size+3)
	}
}

// waitIdle waits until the registry has no open tunnel.
func waitIdle(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if open, _ := tunnels.Counts(); open == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("tunnels still open: %+v", tunnels.Tunnels())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestSandboxEndToEnd(t *testing.T) {
	size := forwardtest.TransferMiB(t, 64) << 20
	up := forwardtest.NewUpstream(t, size+3)
	e := newSandboxEnv(t, nil)
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	to0, from0 := tunnels.Totals()
	before := activityOf(t, e, "sbx-e2e")

	n, recvSum, err := transfer(e.dial(t, "sbx-e2e", up.Addr()), size, 7)
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	checkTunnelTransfer(t, up, size, 7, n, recvSum)
	to1, from1 := tunnels.Totals()
	if to1-to0 != size || from1-from0 != size+3 {
		t.Errorf("registry meters moved %d/%d, want %d/%d", to1-to0, from1-from0, size, size+3)
	}
	after := activityOf(t, e, "sbx-e2e")
	if after.BytesToSandbox-before.BytesToSandbox != size || after.BytesFromSandbox-before.BytesFromSandbox != size+3 ||
		after.TotalTunnels-before.TotalTunnels != 1 || after.OpenTunnels != 0 {
		t.Errorf("GET /sandbox/activity: before %+v after %+v", before, after)
	}
}

// sandboxTotals is one sandbox's entry in GET /sandbox/activity.
type sandboxTotals struct {
	Sandbox          string `json:"sandbox"`
	BytesToSandbox   int64  `json:"bytes_to_sandbox"`
	BytesFromSandbox int64  `json:"bytes_from_sandbox"`
	OpenTunnels      int64  `json:"open_tunnels"`
	TotalTunnels     int64  `json:"total_tunnels"`
}

func activityOf(t testing.TB, e *sandboxEnv, sandbox string) sandboxTotals {
	t.Helper()
	var resp struct {
		Sandboxes []sandboxTotals `json:"sandboxes"`
	}
	e.adminGet(t, "/sandbox/activity", &resp)
	for _, a := range resp.Sandboxes {
		if a.Sandbox == sandbox {
			return a
		}
	}
	return sandboxTotals{Sandbox: sandbox}
}

// Many tunnels at once, of mixed sizes, with half-close each way.
func TestSandboxConcurrentTunnels(t *testing.T) {
	const tunnelsN = 200
	up := forwardtest.NewUpstream(t, 100<<10)
	e := newSandboxEnv(t, nil)
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	var wg sync.WaitGroup
	errs := make(chan error, tunnelsN)
	sem := make(chan struct{}, 50)
	for i := range tunnelsN {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			send := int64(i%7) * 37 << 10
			c := e.dial(t, fmt.Sprintf("sbx-%d", i%10), up.Addr())
			n, sum, err := transfer(c, send, uint64(i))
			if err != nil || n != 100<<10 || sum != forwardtest.PatternSum(2, 100<<10) {
				errs <- fmt.Errorf("tunnel %d: got %d bytes, err %v", i, n, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	waitIdle(t)
	up.Close()
	var total int64
	for _, r := range up.Results() {
		total += r.Received
	}
	var want int64
	for i := range tunnelsN {
		want += int64(i%7) * 37 << 10
	}
	if len(up.Results()) != tunnelsN || total != want {
		t.Errorf("upstream: %d connections, %d bytes; want %d and %d", len(up.Results()), total, tunnelsN, want)
	}
}

// A client certificate outside the leaf allowlist is refused in the
// handshake: nothing is dialed.
func TestSandboxClientNotInAllowlist(t *testing.T) {
	up := forwardtest.NewUpstream(t, 0)
	e := newSandboxEnv(t, nil)
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	stranger := e.ca.Client(t, "not-allowed")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := preamble.Dial(ctx, "tcp", e.addr, e.tlsConfig(stranger), e.gw.Signer, preamble.Claims{SandboxID: "sbx", Target: up.Addr()})
	if err == nil {
		// TLS 1.3: the client learns of the refusal on its first read.
		_, err = c.Read(make([]byte, 1))
		c.Close()
	}
	if err == nil {
		t.Fatal("a client outside the allowlist got through")
	}
	time.Sleep(100 * time.Millisecond)
	if up.Accepted() != 0 {
		t.Fatalf("upstream dialed %d times for a refused client", up.Accepted())
	}
}

// Every refusal: the connection is closed without a byte, ONE log line
// names the reason and the peer, the reason is counted, nothing is dialed.
func TestSandboxRejections(t *testing.T) {
	up := forwardtest.NewUpstream(t, 0)
	closed := netip.MustParseAddrPort(loopbackAddr(t)) // nothing listens here any more
	e := newSandboxEnv(t, map[string]any{"preamble_timeout": "300ms",
		"allow_ports": []string{fmt.Sprint(up.Addr().Port()), fmt.Sprint(closed.Port())}})
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	denied := netip.AddrPortFrom(up.Addr().Addr(), 1) // a port outside allow_ports
	other := forwardtest.NewGateway(t, "gw-1")
	unknown := forwardtest.NewGateway(t, "gw-2")
	// mtls opens the mTLS session and writes raw bytes as the "preamble".
	mtls := func(t *testing.T, payload []byte, halfClose bool) *tls.Conn {
		c, err := tls.Dial("tcp", e.addr, e.tlsConfig(e.client))
		if err != nil {
			t.Fatal(err)
		}
		c.Write(payload)
		if halfClose {
			c.CloseWrite()
		}
		return c
	}
	cases := []struct {
		reason string
		open   func(t *testing.T) *tls.Conn
	}{
		{"bad-signature", func(t *testing.T) *tls.Conn { return mtls(t, other.Frame(t, "sbx", up.Addr()), false) }},
		{"unknown-key", func(t *testing.T) *tls.Conn { return mtls(t, unknown.Frame(t, "sbx", up.Addr()), false) }},
		{"bad-magic", func(t *testing.T) *tls.Conn { return mtls(t, []byte("SSH-2.0-OpenSSH_9.6\r\n"), false) }},
		{"timeout", func(t *testing.T) *tls.Conn { return mtls(t, e.gw.Frame(t, "sbx", up.Addr())[:12], false) }},
		{"truncated", func(t *testing.T) *tls.Conn { return mtls(t, e.gw.Frame(t, "sbx", up.Addr())[:12], true) }},
		{"target-denied", func(t *testing.T) *tls.Conn {
			return mtls(t, e.gw.Frame(t, "sbx", netip.MustParseAddrPort("169.254.169.254:80")), false)
		}},
		{"target-denied", func(t *testing.T) *tls.Conn { // port outside allow_ports
			return mtls(t, e.gw.Frame(t, "sbx", denied), false)
		}},
		{"dial-failed", func(t *testing.T) *tls.Conn {
			return mtls(t, e.gw.Frame(t, "sbx", closed), false)
		}},
		{"binding-mismatch", func(t *testing.T) *tls.Conn {
			f, err := e.gw.Signer.Sign(preamble.Claims{SandboxID: "sbx", Target: up.Addr(), Binding: make([]byte, preamble.BindingLen)})
			if err != nil {
				t.Fatal(err)
			}
			return mtls(t, f, false)
		}},
	}
	want := map[string]int{}
	for i, tc := range cases {
		t.Run(fmt.Sprintf("%d-%s", i, tc.reason), func(t *testing.T) {
			before := tunnels.Rejections()[tc.reason]
			c := tc.open(t)
			defer c.Close()
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			n, err := io.Copy(io.Discard, c)
			if n != 0 {
				t.Errorf("refused client read %d bytes (err %v); want a silent close", n, err)
			}
			deadline := time.Now().Add(5 * time.Second)
			for tunnels.Rejections()[tc.reason] != before+1 {
				if time.Now().After(deadline) {
					t.Fatalf("rejections[%q] = %d, want %d", tc.reason, tunnels.Rejections()[tc.reason], before+1)
				}
				time.Sleep(5 * time.Millisecond)
			}
			want[tc.reason]++
		})
	}
	if up.Accepted() != 0 {
		t.Errorf("upstream accepted %d connections for refused tunnels", up.Accepted())
	}
	got := map[string]int{}
	for _, l := range e.logLines(t, "sandbox tunnel rejected") {
		reason, _ := l["reason"].(string)
		if peer, _ := l["peer"].(string); !strings.HasPrefix(peer, "127.0.0.1:") {
			t.Errorf("log line without the peer: %v", l)
		}
		got[reason]++
	}
	for r, n := range want {
		if got[r] != n {
			t.Errorf("log lines for %q: %d, want %d (all: %v)", r, got[r], n, got)
		}
	}
	// Prometheus, through the admin endpoint, shows the registry's counts.
	body := e.adminBody(t, "/metrics")
	for r := range want {
		line := fmt.Sprintf("caddy_ktls_sandbox_rejects_total{reason=%q} %d\n", r, tunnels.Rejections()[r])
		if !strings.Contains(string(body), line) {
			t.Errorf("/metrics lacks %q", line)
		}
	}
	if !strings.Contains(string(body), `caddy_ktls_sandbox_rejects_total{reason="replayed-nonce"} `) {
		t.Errorf("/metrics has no zero series for reasons not seen yet")
	}
}

// TestKernelSandboxEndToEnd is TestSandboxEndToEnd on a kTLS kernel: the
// kernel must carry the TLS records (tls_stat) and every byte of both
// directions must move by splice(2), none through userspace.
func TestKernelSandboxEndToEnd(t *testing.T) {
	kerneltest.Require(t)
	size := forwardtest.TransferMiB(t, 4) << 20
	up := forwardtest.NewUpstream(t, size)
	e := newSandboxEnv(t, nil)
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	dp0 := tunnels.DataPath()
	var n int64
	var sum [32]byte
	delta := kerneltest.StatDelta(t, func() {
		var err error
		n, sum, err = transfer(e.dial(t, "sbx-kernel", up.Addr()), size, 11)
		if err != nil {
			t.Errorf("transfer: %v", err)
		}
		waitIdle(t)
	})
	up.Close()
	r := up.Results()[0]
	if r.Received != size || r.RecvSum != forwardtest.PatternSum(11, size) || n != size || sum != r.SentSum {
		t.Fatalf("bytes: upstream got %d, client got %d of %d; hashes match: %v %v", r.Received, n, size,
			r.RecvSum == forwardtest.PatternSum(11, size), sum == r.SentSum)
	}
	if delta["TlsTxSw"] < 1 || delta["TlsRxSw"] < 1 {
		t.Errorf("tls_stat delta %v: the kernel did not carry TX and RX", delta)
	}
	dp := tunnels.DataPath()
	if spliced, copied := dp.SpliceBytes-dp0.SpliceBytes, dp.CopyBytes-dp0.CopyBytes; spliced != 2*size || copied != 0 {
		t.Errorf("data path: %d bytes spliced, %d copied; want %d and 0", spliced, copied, 2*size)
	}
	t.Logf("moved %d MiB each way; tls_stat delta %v; data path %+v", size>>20, delta, dp)
}

// Tunnels outlive configuration reloads: 20 POST /load with a changed
// config while tunnels move data; none drops, every hash matches, and the
// new configs keep accepting tunnels.
func TestSandboxReloadsKeepTunnels(t *testing.T) {
	const tunnelsN = 8
	up := forwardtest.NewUpstream(t, 1<<20)
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	stop := make(chan struct{})
	type outcome struct {
		sent, recv int64
		sentSum    [32]byte
		recvSum    [32]byte
		err        error
	}
	results := make(chan outcome, tunnelsN)
	for i := range tunnelsN {
		c := e.dial(t, fmt.Sprintf("sbx-reload-%d", i), up.Addr())
		go func() {
			defer c.Close()
			var o outcome
			werr := make(chan error, 1)
			go func() {
				h := sha256.New()
				src := forwardtest.NewPattern(uint64(100 + i))
				buf := make([]byte, 16<<10)
				for {
					select {
					case <-stop:
						copy(o.sentSum[:], h.Sum(nil))
						werr <- c.CloseWrite()
						return
					default:
					}
					src.Read(buf)
					if _, err := c.Write(buf); err != nil {
						werr <- err
						return
					}
					h.Write(buf)
					o.sent += int64(len(buf))
					time.Sleep(time.Millisecond)
				}
			}()
			h := sha256.New()
			o.recv, o.err = io.Copy(h, c)
			copy(o.recvSum[:], h.Sum(nil))
			if err := <-werr; o.err == nil {
				o.err = err
			}
			results <- o
		}()
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	sandbox := e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)["tunnels"].(map[string]any)["routes"].([]any)[0].(map[string]any)["handle"].([]any)[1].(map[string]any)
	for i := range 20 {
		sandbox["preamble_timeout"] = fmt.Sprintf("%dms", 5000+i)
		body, err := json.Marshal(e.cfg)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := client.Post("http://"+e.adminAddr+"/load", "application/json", strings.NewReader(string(body)))
		if err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
		msg, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("reload %d: %s: %s", i, resp.Status, msg)
		}
		if open, _ := tunnels.Counts(); open != tunnelsN {
			t.Fatalf("after reload %d: %d tunnels open, want %d", i, open, tunnelsN)
		}
	}
	// The last configuration carries new tunnels too.
	if n, sum, err := transfer(e.dial(t, "sbx-after-reload", up.Addr()), 1000, 5); err != nil || n != 1<<20 || sum != forwardtest.PatternSum(2, 1<<20) {
		t.Errorf("tunnel after the reloads: %d bytes, err %v", n, err)
	}
	close(stop)
	sent := map[[32]byte]int64{}
	for range tunnelsN {
		o := <-results
		if o.err != nil || o.recv != 1<<20 {
			t.Errorf("tunnel: received %d bytes, err %v", o.recv, o.err)
		}
		sent[o.sentSum] = o.sent
	}
	waitIdle(t)
	up.Close()
	matched := 0
	for _, r := range up.Results() {
		if n, ok := sent[r.RecvSum]; ok && n == r.Received {
			matched++
		}
	}
	if matched != tunnelsN {
		t.Errorf("%d of %d tunnels delivered exactly what their client sent", matched, tunnelsN)
	}
}

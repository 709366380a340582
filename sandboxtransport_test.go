package caddyktls

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// sandboxApp is a sandbox's HTTP app (HTTP/1.1 and h2c): /echo hashes the
// request body and answers ?size= pattern bytes; /duplex echoes the body
// as it arrives; /ws upgrades to an echo; /sse sends an event, waits for
// the test's go-ahead, sends the next. Every answer names the connection
// it came on (X-Remote: the forwarder's address towards the app).
type sandboxApp struct {
	addr string
	sse  chan struct{}
}

func startSandboxApp(t *testing.T) *sandboxApp {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	app := &sandboxApp{addr: ln.Addr().String(), sse: make(chan struct{})}
	mux := http.NewServeMux()
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		n, _ := io.Copy(h, r.Body)
		size, _ := strconv.ParseInt(r.URL.Query().Get("size"), 10, 64)
		w.Header().Set("X-Remote", r.RemoteAddr)
		w.Header().Set("X-Received", strconv.FormatInt(n, 10))
		w.Header().Set("X-Received-Sha256", hex.EncodeToString(h.Sum(nil)))
		w.Header().Set("X-Proto", r.Proto)
		io.Copy(w, io.LimitReader(forwardtest.NewPattern(9), size))
	})
	mux.HandleFunc("/duplex", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Proto", r.Proto)
		w.WriteHeader(http.StatusOK)
		rc := http.NewResponseController(w)
		rc.EnableFullDuplex()
		rc.Flush()
		buf := make([]byte, 4096)
		for {
			n, err := r.Body.Read(buf)
			if n > 0 {
				w.Write(buf[:n])
				rc.Flush()
			}
			if err != nil {
				return
			}
		}
	})
	mux.HandleFunc("/ws", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "websocket" {
			http.Error(w, "want an upgrade", http.StatusBadRequest)
			return
		}
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		brw.Flush()
		io.Copy(conn, brw) // echo until the client half-closes
	})
	mux.HandleFunc("/sse", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for i := range 3 {
			fmt.Fprintf(w, "data: event-%d\n\n", i)
			rc.Flush()
			if i < 2 {
				select {
				case <-app.sse:
				case <-r.Context().Done():
					return
				}
			}
		}
	})
	srv := &http.Server{Handler: mux, Protocols: new(http.Protocols)}
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true)
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return app
}

// transportEnv is a sandboxEnv (the forwarder) plus an HTTPS site in the
// same Caddy whose reverse_proxy uses the sandbox transport, its sandbox
// ID taken from the host (<sandbox>.sandbox.test).
type transportEnv struct {
	*sandboxEnv
	siteAddr string
	files    gatewayFiles
}

func newTransportEnv(t *testing.T, target string, transportOpts, proxyOpts map[string]any) *transportEnv {
	t.Helper()
	return newTransportEnvWith(t, target, func(_, _ map[string]any) map[string]any { return proxyOpts }, transportOpts)
}

// newTransportEnvWith is newTransportEnv whose reverse_proxy options come
// from edit, which may also change the configuration (cfg) and sees the
// forwarder's sandbox handler JSON.
func newTransportEnvWith(t *testing.T, target string, edit func(cfg, sandbox map[string]any) map[string]any, transportOpts ...map[string]any) *transportEnv {
	t.Helper()
	e := &transportEnv{sandboxEnv: newSandboxConfig(t, nil), siteAddr: loopbackAddr(t)}
	e.files = addGatewaySide(t, e.sandboxEnv)
	sh := e.sandboxHandler()
	transport := e.files.dialJSON()
	transport["protocol"] = "sandbox"
	transport["sandbox"] = "{http.request.host.labels.2}"
	transport["target"] = target
	for _, opts := range transportOpts {
		for k, v := range opts {
			transport[k] = v
		}
	}
	proxy := map[string]any{"handler": "reverse_proxy", "upstreams": []any{map[string]any{"dial": e.addr}}, "flush_interval": -1, "transport": transport}
	e.cfg["apps"].(map[string]any)["http"] = map[string]any{"servers": map[string]any{"gateway": map[string]any{
		"listen":                  []string{e.siteAddr},
		"automatic_https":         map[string]any{"disable": true},
		"tls_connection_policies": []any{map[string]any{}},
		"routes":                  []any{map[string]any{"handle": []any{proxy}}},
	}}}
	for k, v := range edit(e.cfg, sh) {
		if k == "upstreams" {
			ups := v.([]any)
			for i, u := range ups {
				if u.(map[string]any)["dial"] == "{self}" {
					ups[i] = map[string]any{"dial": e.addr}
				}
			}
		}
		proxy[k] = v
	}
	e.start(t)
	return e
}

// user is a user's HTTP client to the site: HTTP/2 when h2, else 1.1.
func (e *transportEnv) user(h2 bool) *http.Client {
	tr := &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: e.ca.Pool},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, e.siteAddr)
		},
		ForceAttemptHTTP2: h2,
	}
	if !h2 {
		tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	return &http.Client{Transport: tr, Timeout: 2 * time.Minute}
}

func siteURL(sandbox, path string) string {
	return "https://" + sandbox + ".sandbox.test" + path
}

// Downloads and uploads over HTTP/1.1 and HTTP/2 from the user, HTTP/1.1
// and h2c to the app, arrive exact; two requests of one sandbox share a
// pooled tunnel.
func TestSandboxTransportExact(t *testing.T) { sandboxTransportExact(t, false) }

func TestKernelSandboxTransportExact(t *testing.T) {
	kerneltest.Require(t)
	sandboxTransportExact(t, true)
}

func sandboxTransportExact(t *testing.T, kernel bool) {
	app := startSandboxApp(t)
	size := forwardtest.TransferMiB(t, 2) << 20
	for _, version := range []string{"1.1", "h2c"} {
		t.Run(version, func(t *testing.T) {
			e := newTransportEnv(t, app.addr, map[string]any{"versions": []string{version}}, nil)
			var before kerneltest.Stat
			if kernel {
				var err error
				if before, err = kerneltest.ReadStat(); err != nil {
					t.Fatal(err)
				}
			}
			for _, h2 := range []bool{false, true} {
				c := e.user(h2)
				sandbox := uniqueSandbox("sbx-http")
				var remotes []string
				for i := range 2 {
					up := io.LimitReader(forwardtest.NewPattern(uint64(i+1)), size+int64(i))
					resp, err := c.Post(siteURL(sandbox, "/echo?size="+strconv.FormatInt(size-int64(i), 10)), "application/octet-stream", up)
					if err != nil {
						t.Fatal(err)
					}
					h := sha256.New()
					n, err := io.Copy(h, resp.Body)
					resp.Body.Close()
					if err != nil || resp.StatusCode != 200 {
						b, _ := os.ReadFile(e.logFile)
						t.Log(string(b))
						t.Fatalf("h2=%v: %s, read %d: %v", h2, resp.Status, n, err)
					}
					wantUp := forwardtest.PatternSum(uint64(i+1), size+int64(i))
					if got := resp.Header.Get("X-Received-Sha256"); got != hex.EncodeToString(wantUp[:]) || resp.Header.Get("X-Received") != strconv.FormatInt(size+int64(i), 10) {
						t.Errorf("h2=%v: the app received %s bytes with another hash", h2, resp.Header.Get("X-Received"))
					}
					if n != size-int64(i) || [32]byte(h.Sum(nil)) != forwardtest.PatternSum(9, size-int64(i)) {
						t.Errorf("h2=%v: the user received %d bytes (want %d) or another hash", h2, n, size-int64(i))
					}
					wantProto := map[string]string{"1.1": "HTTP/1.1", "h2c": "HTTP/2.0"}[version]
					if p := resp.Header.Get("X-Proto"); p != wantProto {
						t.Errorf("the app spoke %s, want %s", p, wantProto)
					}
					remotes = append(remotes, resp.Header.Get("X-Remote"))
				}
				if remotes[0] != remotes[1] {
					t.Errorf("h2=%v: two requests of one sandbox came on %v: want one pooled tunnel", h2, remotes)
				}
			}
			if kernel {
				// Two tunnels (one per user client), each offloaded at the
				// gateway (ktls.Client) and at the forwarder.
				after, err := kerneltest.ReadStat()
				if err != nil {
					t.Fatal(err)
				}
				if tx, rx := after["TlsTxSw"]-before["TlsTxSw"], after["TlsRxSw"]-before["TlsRxSw"]; tx < 4 || rx < 4 {
					t.Errorf("tls_stat: %d TX and %d RX sessions, want at least 4 each", tx, rx)
				}
			}
		})
	}
}

// Two sandboxes never share a tunnel: requests alternate between them, and
// each sandbox's requests all arrive on its own connection, never on the
// other's.
func TestSandboxTransportPoolsPerSandbox(t *testing.T) {
	app := startSandboxApp(t)
	e := newTransportEnv(t, app.addr, nil, nil)
	c := e.user(false)
	seen := map[string]map[string]bool{}
	for i := range 6 {
		sandbox := []string{"sbx-a", "sbx-b"}[i%2]
		resp, err := c.Get(siteURL(sandbox, "/echo?size=10"))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if seen[sandbox] == nil {
			seen[sandbox] = map[string]bool{}
		}
		seen[sandbox][resp.Header.Get("X-Remote")] = true
	}
	for remote := range seen["sbx-a"] {
		if seen["sbx-b"][remote] {
			t.Errorf("sbx-a and sbx-b shared the tunnel %s", remote)
		}
	}
	if len(seen["sbx-a"]) != 1 || len(seen["sbx-b"]) != 1 {
		t.Errorf("tunnels per sandbox %v: want one pooled tunnel each", seen)
	}
	var list []struct{ Sandbox string }
	e.adminGet(t, "/sandbox/tunnels", &list)
	count := map[string]int{}
	for _, tn := range list {
		count[tn.Sandbox]++
	}
	if count["sbx-a"] != 1 || count["sbx-b"] != 1 {
		t.Errorf("the forwarder carries tunnels %v: want one for each sandbox", count)
	}
}

// A WebSocket upgrade, a full-duplex h2c stream (gRPC's shape) and server-
// sent events pass through the tunnel, each unbuffered: the stream's answer
// to one message arrives before the next is sent, and each event before the
// app writes the next.
func TestSandboxTransportStreams(t *testing.T) { sandboxTransportStreams(t) }

// TestKernelSandboxTransportStreams is TestSandboxTransportStreams with the
// tunnels on kTLS at the gateway and the forwarder.
func TestKernelSandboxTransportStreams(t *testing.T) {
	kerneltest.Require(t)
	delta := kerneltest.StatDelta(t, func() { sandboxTransportStreams(t) })
	// Three tunnels (one per stream), each offloaded at both ends.
	if delta["TlsTxSw"] < 6 || delta["TlsRxSw"] < 6 {
		t.Errorf("tls_stat delta %v: want at least 6 TX and 6 RX sessions", delta)
	}
}

func sandboxTransportStreams(t *testing.T) {
	app := startSandboxApp(t)
	t.Run("websocket", func(t *testing.T) {
		e := newTransportEnv(t, app.addr, nil, nil)
		conn, err := tls.Dial("tcp", e.siteAddr, &tls.Config{RootCAs: e.ca.Pool, ServerName: "sbx-ws.sandbox.test", NextProtos: []string{"http/1.1"}})
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "GET /ws HTTP/1.1\r\nHost: sbx-ws.sandbox.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
		br := bufio.NewReader(conn)
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("upgrade: %v %v", resp, err)
		}
		conn.SetDeadline(time.Now().Add(30 * time.Second))
		for i := range 5 {
			msg := []byte(fmt.Sprintf("message %d %s", i, strings.Repeat("x", i*1000)))
			conn.Write(msg)
			got := make([]byte, len(msg))
			if _, err := io.ReadFull(br, got); err != nil || !bytes.Equal(got, msg) {
				t.Fatalf("echo of message %d: %q, %v", i, got, err)
			}
		}
	})
	t.Run("h2c duplex", func(t *testing.T) {
		e := newTransportEnv(t, app.addr, map[string]any{"versions": []string{"h2c"}}, nil)
		pr, pw := io.Pipe()
		req, _ := http.NewRequest("POST", siteURL("sbx-grpc", "/duplex"), pr)
		respc := make(chan *http.Response, 1)
		errc := make(chan error, 1)
		go func() {
			resp, err := e.user(true).Do(req)
			if err != nil {
				errc <- err
				return
			}
			respc <- resp
		}()
		pw.Write([]byte("ping-0"))
		var resp *http.Response
		select {
		case resp = <-respc:
		case err := <-errc:
			t.Fatal(err)
		case <-time.After(30 * time.Second):
			t.Fatal("no response headers while the request stream is open")
		}
		defer resp.Body.Close()
		if resp.ProtoMajor != 2 || resp.Header.Get("X-Proto") != "HTTP/2.0" {
			t.Errorf("user side %s, app side %s: want HTTP/2 on both", resp.Proto, resp.Header.Get("X-Proto"))
		}
		for i := range 5 {
			msg := fmt.Sprintf("ping-%d", i)
			if i > 0 {
				pw.Write([]byte(msg))
			}
			got := make([]byte, len(msg))
			if _, err := io.ReadFull(resp.Body, got); err != nil || string(got) != msg {
				t.Fatalf("echo %d: %q, %v", i, got, err)
			}
		}
		pw.Close()
		if rest, err := io.ReadAll(resp.Body); err != nil || len(rest) != 0 {
			t.Errorf("after the request ended: %q, %v", rest, err)
		}
	})
	t.Run("sse", func(t *testing.T) {
		e := newTransportEnv(t, app.addr, nil, nil)
		resp, err := e.user(false).Get(siteURL("sbx-sse", "/sse"))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		for i := range 3 {
			line, err := br.ReadString('\n')
			if err != nil || line != fmt.Sprintf("data: event-%d\n", i) {
				t.Fatalf("event %d: %q, %v", i, line, err)
			}
			br.ReadString('\n')
			if i < 2 {
				app.sse <- struct{}{} // the app sends the next only now
			}
		}
	})
}

// A tunnel that fails mid-response (the app resets its connection after
// part of its answer; the forwarder passes the failure on) is logged as a
// failure and never retried for a non-idempotent request: the app sees the
// POST once.
func TestSandboxTransportFailureNotRetried(t *testing.T) {
	var posts atomic.Int32
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/reset", func(w http.ResponseWriter, r *http.Request) {
		posts.Add(1)
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Length", "1048576")
		w.Write(make([]byte, 64<<10))
		http.NewResponseController(w).Flush()
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.(*net.TCPConn).SetLinger(0)
			conn.Close()
		}
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	e := newTransportEnv(t, ln.Addr().String(), nil, map[string]any{"load_balancing": map[string]any{"retries": 2}})
	m0 := e.metrics(t)
	resp, err := e.user(false).Post(siteURL("sbx-cut", "/reset"), "text/plain", strings.NewReader("order #1"))
	if err == nil {
		n, rerr := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if rerr == nil {
			t.Errorf("the user read a complete response (%s, %d bytes) of a cut tunnel", resp.Status, n)
		}
	}
	if n := posts.Load(); n != 1 {
		t.Errorf("the app saw the POST %d times, want once", n)
	}
	e.waitLogLine(t, "sandbox transport: the tunnel failed mid-response", 0)
	series := `caddy_ktls_gateway_tunnel_ends_total{end="failed",module="http.reverse_proxy.transport.sandbox"}`
	waitUntil(t, 10*time.Second, func() bool { return e.metrics(t)[series]-m0[series] == 1 }, "the failed tunnel to be counted")
}

// TestKernelSandboxTransportRefusalRetried: the first forwarder refuses the
// target (access_denied: nothing reached the sandbox). A DELETE without a
// body, which reverse_proxy never retries after a failure, is retried on
// the second forwarder as after a dial error, and succeeds; the refusal is
// logged as one and counted.
func TestKernelSandboxTransportRefusalRetried(t *testing.T) {
	kerneltest.Require(t)
	app := startSandboxApp(t)
	refusing := loopbackAddr(t)
	env := newTransportEnvWith(t, app.addr, func(cfg map[string]any, sandbox map[string]any) map[string]any {
		// A second forwarder that allows no loopback target, listed first.
		refuser := map[string]any{}
		for k, v := range sandbox {
			refuser[k] = v
		}
		refuser["allow_cidrs"] = []string{"10.0.0.0/8"}
		servers := cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)
		tunnels := servers["tunnels"].(map[string]any)
		ktlsHandler := tunnels["routes"].([]any)[0].(map[string]any)["handle"].([]any)[0]
		servers["refusing"] = map[string]any{"listen": []string{refusing}, "routes": []any{map[string]any{"handle": []any{ktlsHandler, refuser}}}}
		return map[string]any{
			"upstreams":      []any{map[string]any{"dial": refusing}, map[string]any{"dial": "{self}"}},
			"load_balancing": map[string]any{"retries": 1, "selection_policy": map[string]any{"policy": "first"}},
			// A refusal counts as a failure: the retry goes elsewhere.
			"health_checks": map[string]any{"passive": map[string]any{"fail_duration": "1m", "max_fails": 1}},
		}
	})
	m0 := env.metrics(t)
	req, _ := http.NewRequest("DELETE", siteURL("sbx-retry", "/echo?size=5"), nil)
	resp, err := env.user(false).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || len(body) != 5 {
		t.Errorf("DELETE: %s with %d bytes, want 200 with 5 after the retry", resp.Status, len(body))
	}
	line := env.waitLogLine(t, "sandbox transport: the forwarder refused the tunnel (its log names the reason); nothing reached the sandbox", 0)
	if line["retry_safe"] != true || line["forwarder"] != refusing {
		t.Errorf("refusal log %v: want retry_safe from %s", line, refusing)
	}
	if got := env.metrics(t)[`caddy_ktls_sandbox_rejects_total{reason="target-denied"}`] - m0[`caddy_ktls_sandbox_rejects_total{reason="target-denied"}`]; got != 1 {
		t.Errorf("target-denied rejects moved by %d, want 1", got)
	}
}

// The forwarder, a process of its own, is killed while a response streams
// through its tunnel: the user's response is cut, the gateway logs a
// failure mid-response and counts the tunnel failed, and the POST is not
// sent again (the app sees it once) although reverse_proxy may retry.
func TestSandboxTransportForwarderKilled(t *testing.T) {
	var posts atomic.Int32
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		posts.Add(1)
		io.Copy(io.Discard, r.Body)
		rc := http.NewResponseController(w)
		for range 600 { // a minute at most
			if _, err := w.Write(make([]byte, 16<<10)); err != nil {
				return
			}
			rc.Flush()
			time.Sleep(100 * time.Millisecond)
		}
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })

	fwdAddr := loopbackAddr(t)
	e := newTransportEnvWith(t, ln.Addr().String(), func(_, _ map[string]any) map[string]any {
		return map[string]any{"upstreams": []any{map[string]any{"dial": fwdAddr}}, "load_balancing": map[string]any{"retries": 2}}
	})
	// The forwarder process: this configuration's forwarder (same
	// certificates and keys) on its own address, without the gateway.
	var fwd sandboxEnv = *e.sandboxEnv
	fwd.cfg = cloneJSON(t, e.cfg)
	apps := fwd.cfg["apps"].(map[string]any)
	delete(apps, "http")
	apps["layer4"].(map[string]any)["servers"].(map[string]any)["tunnels"].(map[string]any)["listen"] = []string{fwdAddr}
	fwd.addr, fwd.adminAddr, fwd.logFile = fwdAddr, loopbackAddr(t), filepath.Join(t.TempDir(), "forwarder.log")
	fwd.cfg["admin"].(map[string]any)["listen"] = fwd.adminAddr
	fwd.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["writer"].(map[string]any)["filename"] = fwd.logFile
	p := startCaddy(t, &fwd, "")

	m0 := e.metrics(t)
	resp, err := e.user(false).Post(siteURL("sbx-killed", "/stream"), "text/plain", strings.NewReader("order #2"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := io.ReadFull(resp.Body, make([]byte, 32<<10)); err != nil {
		t.Fatalf("the first chunks: %v", err)
	}
	p.cmd.Process.Kill()
	n, err := io.Copy(io.Discard, resp.Body)
	if err == nil {
		t.Errorf("the user read the rest of a cut response (%d more bytes) without an error", n)
	}
	if got := posts.Load(); got != 1 {
		t.Errorf("the app saw the POST %d times, want once", got)
	}
	e.waitLogLine(t, "sandbox transport: the tunnel failed mid-response", 0)
	series := `caddy_ktls_gateway_tunnel_ends_total{end="failed",module="http.reverse_proxy.transport.sandbox"}`
	waitUntil(t, 10*time.Second, func() bool { return e.metrics(t)[series]-m0[series] == 1 }, "the failed tunnel to be counted")
}

// cloneJSON deep-copies a configuration through JSON.
func cloneJSON(t *testing.T, v map[string]any) map[string]any {
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

package caddyktls

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// TestListenerWrapperSandboxShape is the forwarder shape: an HTTPS server
// with client authentication whose listener wrappers are `ktls` and then
// `layer4` routing sandbox preambles to the sandbox handler. A tunnel and an
// HTTPS request share the port; on this kernel both run on userspace TLS.
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

func lwSandboxShape(t *testing.T, kernel bool) {
	lwCheckLeaks(t)
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	size := forwardtest.TransferMiB(t, int64(lwTestMiB(t))) << 20
	ca := testpki.NewCA(t, "sandbox shape CA")
	server, client := ca.Server(t), ca.Client(t, "gateway-9")
	gw := forwardtest.NewGateway(t, "gw-9")
	up := forwardtest.NewUpstream(t, size+3)
	port := lwFreePort(t)
	sandbox := map[string]any{
		"handler":     "sandbox",
		"keys":        []any{map[string]any{"id": "gw-9", "public_key": base64.StdEncoding.EncodeToString(gw.Pub)}},
		"allow_cidrs": []string{"127.0.0.0/8"},
		// The sandbox handler binds to the session the ktls wrapper carries
		// (caddy-l4's HTTP wrapper records no TLS state of its own).
		"require_channel_binding": true,
	}
	cfg := map[string]any{
		"admin": map[string]any{"disabled": true, "config": map[string]any{"persist": false}},
		// Caddy's default storage path is fixed at init, before t.Setenv.
		"storage": map[string]any{"module": "file_system", "root": filepath.Join(dir, "storage")},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{
			"writer": map[string]any{"output": "discard"},
		}}},
		"apps": map[string]any{
			"tls": map[string]any{"certificates": map[string]any{"load_pem": []any{
				map[string]any{"certificate": string(server.CertPEM), "key": string(server.KeyPEM)},
			}}},
			"http": map[string]any{"https_port": port, "servers": map[string]any{"edge": map[string]any{
				"listen":          []string{fmt.Sprintf("127.0.0.1:%d", port)},
				"automatic_https": map[string]any{"disable": true},
				"listener_wrappers": []any{
					map[string]any{"wrapper": "ktls"},
					map[string]any{"wrapper": "layer4", "routes": []any{map[string]any{
						"match":  []any{map[string]any{"sandbox": map[string]any{}}},
						"handle": []any{sandbox},
					}}},
				},
				"tls_connection_policies": []any{map[string]any{"client_authentication": map[string]any{
					"ca":   map[string]any{"provider": "inline", "trusted_ca_certs": []string{base64.StdEncoding.EncodeToString(ca.Cert.Raw)}},
					"mode": "require_and_verify",
				}}},
				"routes": []any{map[string]any{"handle": []any{map[string]any{"handler": "static_response",
					"body": "{http.request.tls.version} cn={http.request.tls.client.subject}"}}}},
			}}},
		},
	}
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(raw, true); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() {
		if err := caddy.Load([]byte(`{"admin":{"disabled":true,"config":{"persist":false}}}`), true); err != nil {
			t.Errorf("unload: %v", err)
		}
	})
	clientTLS := &tls.Config{RootCAs: ca.Pool, ServerName: "localhost", Certificates: []tls.Certificate{client.TLS}}
	addr := fmt.Sprintf("127.0.0.1:%d", port)

	// The tunnel: a preamble bound to this TLS session, then data both ways.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := preamble.Dial(ctx, "tcp", addr, clientTLS, gw.Signer, preamble.Claims{SandboxID: "sbx-http", Target: up.Addr()})
	if err != nil {
		t.Fatalf("dial with a bound preamble: %v", err)
	}
	dp0 := tunnels.DataPath()
	n, recvSum, err := transfer(conn, size, 11)
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	checkTunnelTransfer(t, up, size, 11, n, recvSum)

	// Which data path moved the tunnel's bytes: splice on kTLS, else copy.
	// The bytes layer4 read ahead while matching the preamble (at most its
	// prefetch, flushed to the sandbox first) are counted by neither.
	dp := tunnels.DataPath()
	spliced, copied := dp.SpliceBytes-dp0.SpliceBytes, dp.CopyBytes-dp0.CopyBytes
	moved, prefetch := 2*size+3, int64(64<<10)
	if kernel && (spliced < moved-prefetch || spliced > moved || copied != 0) {
		t.Errorf("kTLS tunnel: %d bytes spliced, %d copied; want all %d (less a prefetch) spliced", spliced, copied, moved)
	}
	if !kernel && (copied < moved-prefetch || copied > moved || spliced != 0) {
		t.Errorf("userspace TLS tunnel: %d bytes copied, %d spliced; want all %d (less a prefetch) copied", copied, spliced, moved)
	}

	// HTTPS on the same port falls through layer4 to the HTTP server, and
	// the request still sees the TLS session.
	if forwardtest.RaceEnabled {
		// caddy-l4 v0.1.2 reads a piped connection's byte counters for its
		// "connection stats" debug line (layer4/listener.go:189) while HTTP
		// already uses the connection: a race in caddy-l4, not here.
		t.Log("race detector on: not sending HTTPS through caddy-l4's listener wrapper (caddy-l4 v0.1.2 data race)")
		return
	}
	hc := &http.Client{Timeout: time.Minute, Transport: &http.Transport{TLSClientConfig: clientTLS, ForceAttemptHTTP2: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}}}
	defer hc.CloseIdleConnections()
	resp, err := hc.Get("https://localhost/")
	if err != nil {
		t.Fatalf("HTTPS through layer4: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if got := string(body); got != "tls1.3 cn=CN=gateway-9" {
		t.Errorf("HTTPS through layer4: %q over HTTP/%d", got, resp.ProtoMajor)
	}
}

// lwCheckLeaks fails t when, after its cleanups, the process holds more
// fds or goroutines than now. Pipes the splice package's process-wide pool
// keeps for reuse (two fds each) are not leaks.
func lwCheckLeaks(t *testing.T) {
	t.Helper()
	pool := splice.DefaultPipePool()
	fds, goroutines, idle := kerneltest.OpenFDs(t), runtime.NumGoroutine(), pool.Stats().Idle
	t.Cleanup(func() {
		deadline := time.Now().Add(10 * time.Second)
		for {
			pooled := 2 * (pool.Stats().Idle - idle)
			nf, ng := kerneltest.OpenFDs(t)-pooled, runtime.NumGoroutine()
			if nf <= fds && ng <= goroutines {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("leak: fds %d -> %d (not counting %d pooled pipe fds), goroutines %d -> %d", fds, nf, pooled, goroutines, ng)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

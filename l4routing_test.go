package caddyktls

import (
	"crypto/tls"
	"io"
	"maps"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/mholt/caddy-l4/layer4"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// Routes around the layer4 `ktls` handler in real caddy-l4 configuration:
// a matcher that prefetches the ClientHello before it, a caddy-l4 handler
// that layers a userspace reader under it, and routing on the terminated
// session after it. Each has a host twin (userspace fallback, skipped where
// the kernel has kTLS) and a kernel twin for the VM.

// routingTunnelSize is what each tunnel of these tests moves each way (the
// upstream sends 3 bytes more): small, as the VM emulates AES slowly.
const routingTunnelSize = 1 << 20

// skipOnKTLS skips a host twin where the kernel has kTLS: there the
// handshakes are offloaded and the Kernel twin covers the route.
func skipOnKTLS(t *testing.T, twin string) {
	t.Helper()
	if kerneltest.Available() == nil {
		t.Skipf("kTLS is available here: %s covers this kernel", twin)
	}
}

// offloadReason is the reason a handshake that nothing else keeps in
// userspace is counted under: offloaded in the VM, no kernel support on the
// host twin's kernel.
func offloadReason(kernel bool) ktls.Reason {
	if kernel {
		return ktls.ReasonNone
	}
	return ktls.ReasonNoKernelSupport
}

// startRouted starts a sandboxEnv whose route configure changed, with an
// upstream for one routingTunnelSize tunnel, and scrapes /metrics before
// any connection.
func startRouted(t *testing.T, configure func(e *sandboxEnv)) (*sandboxEnv, *forwardtest.Upstream, map[string]int64) {
	t.Helper()
	up := forwardtest.NewUpstream(t, routingTunnelSize+3)
	e := newSandboxConfig(t, nil)
	configure(e)
	e.start(t)
	forwardtest.CheckLeaks(t)
	return e, up, e.metrics(t)
}

// TestSandboxPrefetchedClientHello: a caddy-l4 `tls` matcher (sni) before
// `ktls` prefetches the ClientHello into the layer4 connection's buffer to
// match it; the ktls handshake must read it from there (the socket no longer
// has it), so the tunnel works and the handshake counts once. A ClientHello
// for another name matches no route: closed before any handshake or dial.
func TestSandboxPrefetchedClientHello(t *testing.T) {
	skipOnKTLS(t, "TestKernelSandboxPrefetchedClientHello")
	sandboxPrefetchedClientHello(t, false)
}

// TestKernelSandboxPrefetchedClientHello is the same on a kTLS kernel: once
// the handshake has used up the prefetched bytes, nothing is left buffered,
// so the session is offloaded (reason none, tls_stat TX and RX) and every
// tunnel byte is spliced.
func TestKernelSandboxPrefetchedClientHello(t *testing.T) {
	kerneltest.Require(t)
	sandboxPrefetchedClientHello(t, true)
}

func sandboxPrefetchedClientHello(t *testing.T, kernel bool) {
	e, up, before := startRouted(t, func(e *sandboxEnv) {
		e.route()["match"] = []any{map[string]any{"tls": map[string]any{"sni": []string{"localhost"}}}}
	})
	splicedSince := dataPathCheck(t, kernel, 1)

	other := e.tlsConfig(e.client)
	other.ServerName = "elsewhere.test"
	if c, err := tls.Dial("tcp", e.addr, other); err == nil {
		c.Close()
		t.Fatal("a ClientHello for elsewhere.test got a handshake: the tls matcher did not route on it")
	}
	e.exactTunnel(t, "sbx-prefetch", up, routingTunnelSize, 21)
	if accepted := up.Accepted(); accepted != 1 {
		t.Errorf("upstream accepted %d connections, want the tunnel's only", accepted)
	}
	e.checkHandshakes(t, before, map[ktls.Reason]int64{offloadReason(kernel): 1})
	if spliced := splicedSince(); kernel && spliced != 2*routingTunnelSize+3 {
		t.Errorf("%d bytes spliced, want %d", spliced, 2*routingTunnelSize+3)
	}
}

// coalescingConn passes its first write through and holds the later ones
// until flush, which writes them all at once: a gateway that sends its
// Finished and its first application bytes in one segment.
type coalescingConn struct {
	net.Conn
	mu      sync.Mutex
	writes  int // before flush
	flushed bool
	held    []byte
}

func (c *coalescingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.writes++; c.writes > 1 && !c.flushed {
		c.held = append(c.held, p...)
		return len(p), nil
	}
	return c.Conn.Write(p)
}

func (c *coalescingConn) flush() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.flushed = true
	_, err := c.Conn.Write(c.held)
	return err
}

// TestSandboxUserspaceLayerFallback: caddy-l4's proxy_protocol handler
// before `ktls` hands it the connection through go-proxyproto's buffered
// reader, a userspace layer whose buffer the kernel would never see. The
// gateway sends the PROXY header, then its Finished and the preamble in one
// segment. The tunnel must work with exact bytes both ways (SHA-256), copied
// in userspace, and carry the PROXY header's client address as its peer.
//
// Why this route and not a matcher: `ktls` also refuses to offload while
// caddy-l4's own prefetch buffer (MatchingBytes) holds bytes, but no real
// caddy-l4 route leaves bytes there after a successful handshake. Matchers
// run, and prefetch, only before `ktls`, when the server has not sent
// anything, so every byte they can have buffered was sent before the
// client's Finished (which needs the server's flight) and the handshake
// reads the stream in order, record by record, up to that Finished: it uses
// up the buffer. After `ktls`, caddy-l4 prefetches through the decrypted
// connection. That branch is proven at the ktls level instead
// (ktls.TestLayeredSocket, ktls.TestKernelLayered).
func TestSandboxUserspaceLayerFallback(t *testing.T) {
	skipOnKTLS(t, "TestKernelSandboxUserspaceLayerFallback")
	sandboxUserspaceLayerFallback(t, false)
}

// TestKernelSandboxUserspaceLayerFallback is the same on a kTLS kernel: the
// session falls back with reason buffered-bytes (counted in
// caddy_ktls_handshakes_total), installs no key (tls_stat) and the tunnel
// is copied, not spliced.
func TestKernelSandboxUserspaceLayerFallback(t *testing.T) {
	kerneltest.Require(t)
	sandboxUserspaceLayerFallback(t, true)
}

func sandboxUserspaceLayerFallback(t *testing.T, kernel bool) {
	const sandbox, peer = "sbx-proxy-protocol", "192.0.2.7:40000"
	e, up, before := startRouted(t, func(e *sandboxEnv) {
		e.recordTunnelEvents()
		route := e.route()
		route["handle"] = append([]any{map[string]any{"handler": "proxy_protocol", "allow": []string{"127.0.0.0/8"}}},
			route["handle"].([]any)...)
	})
	// The kernel probe installs keys of its own on its first call: not in
	// this test's tls_stat delta.
	ktls.Probe()
	delta := dataPathDelta(t, kernel)

	raw, err := net.Dial("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(raw, "PROXY TCP4 192.0.2.7 127.0.0.1 40000 443\r\n"); err != nil {
		t.Fatal(err)
	}
	cc := &coalescingConn{Conn: raw}
	c := tls.Client(cc, e.tlsConfig(e.client))
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if err := c.Handshake(); err != nil { // TLS 1.3: done once the Finished is written (held)
		c.Close()
		t.Fatalf("handshake: %v", err)
	}
	binding, _ := preamble.ChannelBinding(c.ConnectionState())
	frame, err := e.gw.Signer.Sign(preamble.Claims{SandboxID: sandbox, Target: up.Addr(), Binding: binding})
	if err == nil {
		_, err = c.Write(frame)
	}
	if err == nil {
		err = cc.flush()
	}
	if err != nil {
		c.Close()
		t.Fatal(err)
	}
	c.SetDeadline(time.Time{})
	n, sum, err := transfer(c, routingTunnelSize, 22)
	if err != nil {
		t.Fatalf("tunnel behind proxy_protocol: %v", err)
	}
	checkTunnelTransfer(t, up, routingTunnelSize, 22, n, sum)
	if opened := recordedEvent(t, "sandbox_tunnel_opened", sandbox); opened["peer"] != peer {
		t.Errorf("tunnel peer %v, want the PROXY header's %s", opened["peer"], peer)
	}
	// The connection's own reason, decided before the kernel is asked: the
	// same on a host without kTLS.
	e.checkHandshakes(t, before, map[ktls.Reason]int64{ktls.ReasonBufferedBytes: 1})
	stat, dp := delta()
	if dp.CopyBytes != 2*routingTunnelSize+3 || dp.SpliceBytes != 0 {
		t.Errorf("data path: %d bytes copied, %d spliced; want all %d copied", dp.CopyBytes, dp.SpliceBytes, 2*routingTunnelSize+3)
	}
	if kernel && (stat["TlsTxSw"] != 0 || stat["TlsRxSw"] != 0) {
		t.Errorf("tls_stat delta %v: a key was installed for a session that fell back", stat)
	}
}

// TestSandboxRoutesOnSession: after `ktls`, a subroute routes on the
// terminated session through the connection's {l4.tls.*} placeholders
// (caddy-l4's `vars` matcher on {l4.tls.proto}, the negotiated ALPN): a
// tunnel reaches the sandbox handler, an "echo/1" session the echo handler.
//
// caddy-l4's `tls` matcher (sni, alpn) does not route there: it parses a
// ClientHello from the connection's bytes, which after `ktls` (as after
// caddy-l4's own `tls` handler) are the decrypted stream. Its route, first
// and closing the connection, must never match.
func TestSandboxRoutesOnSession(t *testing.T) {
	skipOnKTLS(t, "TestKernelSandboxRoutesOnSession")
	sandboxRoutesOnSession(t, false)
}

// TestKernelSandboxRoutesOnSession is the same on a kTLS kernel: both
// sessions are offloaded (reason none) and the tunnel is spliced.
func TestKernelSandboxRoutesOnSession(t *testing.T) {
	kerneltest.Require(t)
	sandboxRoutesOnSession(t, true)
}

func sandboxRoutesOnSession(t *testing.T, kernel bool) {
	onProto := func(proto string) []any {
		return []any{map[string]any{"vars": map[string]any{"{l4.tls.proto}": []string{proto}}}}
	}
	e, up, before := startRouted(t, func(e *sandboxEnv) {
		route := e.route()
		handlers := route["handle"].([]any)
		ktlsHandler, sandboxHandler := handlers[0].(map[string]any), handlers[1]
		ktlsHandler["connection_policies"].([]any)[0].(map[string]any)["alpn"] = []string{"sandbox/1", "echo/1"}
		route["handle"] = []any{ktlsHandler, map[string]any{
			"handler": "subroute",
			"routes": []any{
				map[string]any{"match": []any{map[string]any{"tls": map[string]any{"sni": []string{"localhost"}}}},
					"handle": []any{map[string]any{"handler": "close"}}},
				map[string]any{"match": onProto("sandbox/1"), "handle": []any{sandboxHandler}},
				map[string]any{"match": onProto("echo/1"), "handle": []any{map[string]any{"handler": "echo"}}},
			},
		}}
	})
	rejected := forwarder.Tunnels().RefusedTunnels()
	splicedSince := dataPathCheck(t, kernel, 1)

	cfg := e.tlsConfig(e.client)
	cfg.NextProtos = []string{"sandbox/1"}
	n, sum, err := transfer(e.dialWith(t, cfg, e.gw.Signer, "sbx-session-route", up.Addr()), routingTunnelSize, 23)
	if err != nil {
		t.Fatalf("tunnel routed on ALPN sandbox/1: %v", err)
	}
	checkTunnelTransfer(t, up, routingTunnelSize, 23, n, sum)

	cfg = e.tlsConfig(e.client)
	cfg.NextProtos = []string{"echo/1"}
	const hello = "not a tunnel: echo me"
	c, err := tls.Dial("tcp", e.addr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	_, err = io.WriteString(c, hello)
	if err == nil {
		err = c.CloseWrite()
	}
	echo, rerr := io.ReadAll(c)
	c.Close()
	if err != nil || rerr != nil || string(echo) != hello {
		t.Errorf("the echo/1 route answered %q (write %v, read %v), want %q", echo, err, rerr, hello)
	}

	if accepted := up.Accepted(); accepted != 1 {
		t.Errorf("upstream accepted %d connections, want the tunnel's only", accepted)
	}
	if now := forwarder.Tunnels().RefusedTunnels(); !maps.Equal(now, rejected) {
		t.Errorf("rejections changed from %v to %v: the echo/1 session reached the sandbox handler", rejected, now)
	}
	e.checkHandshakes(t, before, map[ktls.Reason]int64{offloadReason(kernel): 2})
	// The subroute's matchers prefetched the tunnel's first decrypted bytes
	// (at most MaxBufLen, the preamble among them); the sandbox handler
	// writes those past the preamble to the target before splicing the rest.
	const total = 2*routingTunnelSize + 3
	if spliced := splicedSince(); kernel && (spliced > total || spliced <= total-layer4.MaxBufLen) {
		t.Errorf("%d bytes spliced, want all %d but the prefetched ones (< %d)", spliced, total, layer4.MaxBufLen)
	}
}

package caddyktls

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestL4FallbackRefuse: the layer4 `ktls` handler with `fallback refuse`
// on a kernel without kTLS loads (the configuration means the same on every
// machine) and says once that it refuses every connection; each connection
// then ends as refused after its handshake: a reset, never the close_notify
// of a complete stream, nothing reaches the next handler, counted as
// refused and logged below WARN.
func TestL4FallbackRefuse(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelL4FallbackRefuse covers this kernel")
	}
	l4FallbackRefuse(t, false)
}

// TestKernelL4FallbackRefuse is TestL4FallbackRefuse on a kTLS kernel with
// a session the kernel cannot take (TLS 1.2 with a CBC suite): refused the
// same way, and no WARN at load, as other sessions are offloaded.
func TestKernelL4FallbackRefuse(t *testing.T) {
	kerneltest.Require(t)
	l4FallbackRefuse(t, true)
}

func l4FallbackRefuse(t *testing.T, kernel bool) {
	up := forwardtest.NewUpstream(t, 1<<10)
	e := newSandboxConfig(t, nil)
	handler := e.route()["handle"].([]any)[0].(map[string]any)
	handler["require_offload"] = true
	clientCfg := e.tlsConfig(e.client)
	wantReason := ktls.ReasonNoKernelSupport
	if kernel {
		policy := handler["connection_policies"].([]any)[0].(map[string]any)
		policy["protocol_min"] = "tls1.2"
		policy["cipher_suites"] = []string{tls.CipherSuiteName(lwCBCSuite), "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"}
		clientCfg.MinVersion, clientCfg.MaxVersion, clientCfg.CipherSuites = tls.VersionTLS12, tls.VersionTLS12, []uint16{lwCBCSuite}
		wantReason = ktls.ReasonCipher
	}
	e.start(t)
	if n, want := len(e.logLines(t, offload.RefuseAllWarning)), map[bool]int{false: 1, true: 0}[kernel]; n != want {
		t.Errorf("%d load WARNs that every connection will be refused, want %d", n, want)
	}
	refused := `caddy_ktls_connections_closed_total{event="refused",module="layer4.handlers.ktls"}`
	before := e.metrics(t)
	if _, ok := before[refused]; !ok {
		t.Fatalf("no %s series before any refusal", refused)
	}
	const conns = 3
	for range conns {
		c, err := tls.Dial("tcp", e.addr, clientCfg)
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		c.SetReadDeadline(time.Now().Add(30 * time.Second))
		n, err := io.Copy(io.Discard, c)
		err = sockerr.ReadError(c, err)
		c.Close()
		if n != 0 || !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("the client read %d bytes, then %v; want a reset (a refusal in userspace TLS), never an orderly end", n, err)
		}
	}
	checkMetricDeltas(t, before, e.metrics(t), map[string]int64{refused: conns, handshakeSeries(wantReason): conns})
	if up.Accepted() != 0 {
		t.Errorf("upstream accepted %d connections; a refused connection must reach no handler after ktls", up.Accepted())
	}
	for _, l := range append(e.logLines(t, "handling connection"), e.logLines(t, "kTLS connection event")...) {
		t.Errorf("a refusal logged at %v: %v; want it below WARN (counted, and said once at load)", l["level"], l)
	}
	if n := len(e.logLines(t, "kTLS connection refused: it cannot be offloaded and fallback is refuse")); n != 0 {
		t.Errorf("%d refusal lines at the sandboxEnv's INFO level, want none (DEBUG)", n)
	}
}

// TestListenerWrapperFallbackRefuse: the `ktls` listener wrapper with
// `fallback refuse` on a kernel without kTLS loads like the layer4 handler
// (validation does not depend on the validating machine's kernel), warns
// once per wrapper, and refuses every
// HTTPS connection with a reset after its handshake, counted.
func TestListenerWrapperFallbackRefuse(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperOptions refuses a CBC client on this kernel")
	}
	s := lwStart(t, &lwSite{wrapper: map[string]any{"require_offload": true}, refusesAll: true})
	// One per TLS listener: the site's HTTPS listener, not its HTTP one
	// (whose plain connections are not refused).
	if n := len(jsonLogLines(t, s.logFile, offload.RefuseAllWarning)); n != 1 {
		t.Errorf("%d load WARNs that every connection will be refused, want 1 (the HTTPS listener's)", n)
	}
	refused := `caddy_ktls_connections_closed_total{event="refused",module="caddy.listeners.ktls"}`
	before := parseMetrics(t, adminGet(t, s.adminAddr, "/metrics"))
	const conns = 2
	for range conns {
		cfg := s.tlsConfig(nil, false)
		cfg.ServerName = "localhost"
		c, err := tls.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", s.port), cfg)
		if err != nil {
			t.Fatalf("handshake: %v", err)
		}
		c.SetDeadline(time.Now().Add(30 * time.Second))
		_, werr := c.Write([]byte("GET /tls HTTP/1.1\r\nHost: localhost\r\n\r\n"))
		n, err := io.Copy(io.Discard, c)
		err = sockerr.ReadError(c, err)
		c.Close()
		// The kernel reports a reset once: to the write when it arrived
		// first (the read then sees the end of the stream), else to the read.
		reset := errors.Is(err, syscall.ECONNRESET) || errors.Is(werr, syscall.ECONNRESET) || errors.Is(werr, syscall.EPIPE)
		if n != 0 || !reset {
			t.Errorf("the client wrote (%v), read %d bytes, then %v; want a reset, never a response or an orderly end", werr, n, err)
		}
	}
	after := parseMetrics(t, adminGet(t, s.adminAddr, "/metrics"))
	if got := after[refused] - before[refused]; got != conns {
		t.Errorf("%s rose by %v, want %d", refused, got, conns)
	}
}

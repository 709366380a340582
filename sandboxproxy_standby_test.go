package caddyktls

import (
	"strings"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// sandbox_proxy with `standby 2` keeps two connections to the forwarder
// ready, mutual TLS done: the forwarder holds them as standby, not as
// preambles late; the next user's tunnel goes on one and carries every
// byte. A reload closes the old module's standby connections, which the
// forwarder counts as closed unused, never as refused tunnels.
func TestSandboxProxyStandby(t *testing.T) { sandboxProxyStandby(t, false) }

// TestKernelSandboxProxyStandby is TestSandboxProxyStandby on kTLS: a
// standby connection is offloaded like any, and the tunnel on it splices
// kTLS to kTLS.
func TestKernelSandboxProxyStandby(t *testing.T) {
	kerneltest.Require(t)
	sandboxProxyStandby(t, true)
}

func sandboxProxyStandby(t *testing.T, kernel bool) {
	const size = 256 << 10
	up := forwardtest.NewUpstream(t, size+3)
	// standby_max_idle well past the waits below: only the reload closes them.
	e := newGatewayEnv(t, map[string]any{"target": up.Addr().String(), "standby": 2, "standby_max_idle": "10m"})
	waitIdle(t)
	const (
		waiting = "caddy_ktls_sandbox_standby_connections"
		used    = `caddy_ktls_gateway_standby_total{module="layer4.handlers.sandbox_proxy",outcome="used"}`
		closed  = `caddy_ktls_sandbox_standby_ends_total{end="closed"}`
	)
	m0 := e.metrics(t)
	tunnel := func(seed uint64) {
		t.Helper()
		n, recvSum, err := transfer(e.userDial(t, uniqueSandbox("sbx-standby")), size, seed)
		if err != nil {
			t.Fatalf("tunnel: %v", err)
		}
		if n != size+3 || recvSum != forwardtest.PatternSum(2, size+3) {
			t.Errorf("the user received %d bytes, want %d with the upstream's hash", n, size+3)
		}
	}
	tunnel(1) // the first dial to the forwarder: a connection of its own
	waitUntil(t, 30*time.Second, func() bool { return e.metric(t, waiting) == 2 }, "the forwarder to hold 2 standby connections")
	if d := e.metric(t, used) - m0[used]; d != 0 {
		t.Fatalf("%d standby connections used before any was ready", d)
	}
	m1 := e.metrics(t)
	tunnel(2)
	waitUntil(t, 30*time.Second, func() bool { return e.metric(t, waiting) == 2 }, "the standby connections to be refilled")
	m2 := e.metrics(t)
	if d := m2[used] - m1[used]; d != 1 {
		t.Errorf("%s moved by %d, want 1", used, d)
	}
	if copied := m2[`caddy_ktls_gateway_relay_bytes_total{path="copy"}`] - m1[`caddy_ktls_gateway_relay_bytes_total{path="copy"}`]; kernel && copied != 0 {
		t.Errorf("the tunnel on a standby connection copied %d bytes through userspace, want 0", copied)
	}
	up.Close()
	for i, r := range up.Results() {
		if r.Received != size || r.RecvSum != forwardtest.PatternSum(uint64(i+1), size) && r.RecvSum != forwardtest.PatternSum(uint64(2-i), size) {
			t.Errorf("upstream connection %d received %d bytes, want %d with a tunnel's hash", i, r.Received, size)
		}
	}

	e.proxyHandler()["dial_timeout"] = "9s" // a changed configuration, or Caddy would skip the load
	e.postLoad(t)
	waitUntil(t, 30*time.Second, func() bool { return e.metric(t, closed)-m0[closed] == 2 },
		"the forwarder to count the old module's 2 standby connections closed")
	m3 := e.metrics(t)
	for series, v := range m3 {
		if strings.HasPrefix(series, "caddy_ktls_sandbox_rejects_total") && v != m0[series] {
			t.Errorf("%s moved by %d, want no refused tunnel", series, v-m0[series])
		}
	}
	if n := m3[waiting]; n != 0 {
		t.Errorf("%d standby connections still waiting after the reload, want 0 (the new module has dialed nothing)", n)
	}
}

package caddyktls

import (
	"crypto/tls"
	"fmt"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestKernelSandboxTunnelStacks: an open kernel TLS tunnel holds the
// stacks its two relay goroutines need while they wait, not the one its
// opening grew. The caller of the sandbox handler (caddy-l4's goroutine
// for the connection) carries one direction to the tunnel's end, parked
// some 11 KiB deep; the preamble's check and the target's dial below that
// depth grew it to 32 KiB, which it kept (a goroutine's stack shrinks only
// while it uses less than a quarter of it). They run on a goroutine of
// their own, which ends with them. Read from the real binary's own runtime
// (/metrics), so that nothing of this process counts. Kernel only: a
// userspace TLS session's relay grows its stacks itself, in crypto/tls.
func TestKernelSandboxTunnelStacks(t *testing.T) {
	kerneltest.Require(t)
	sandboxTunnelStacks(t)
}

func sandboxTunnelStacks(t *testing.T) {
	const n = 64
	// One byte, then nothing until the tunnel ends: both directions wait.
	up := forwardtest.NewPacedUpstream(t, 1, time.Hour)
	e := newSandboxConfig(t, nil)
	p := startCaddy(t, e, "")
	read := func() (stacks, goroutines int64) { return goStacks(t, e) }
	stacks0, g0 := read()
	conns := make([]*ktls.Conn, n)
	for i := range conns {
		conns[i] = e.dial(t, fmt.Sprintf("sbx-stack-%d", i%8), up.Addr())
	}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	// Open when the process runs two goroutines per tunnel: both
	// directions parked in the relay.
	deadline := time.Now().Add(30 * time.Second)
	stacks1, g1 := read()
	for g1-g0 != 2*n {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines more than before %d tunnels, want 2 per tunnel", g1-g0, n)
		}
		time.Sleep(20 * time.Millisecond)
		stacks1, g1 = read()
	}
	per := float64(stacks1-stacks0) / n
	t.Logf("%d tunnels: %.1f KiB of goroutine stacks per tunnel (caddy pid %d)", n, per/1024, p.cmd.Process.Pid)
	// Two stacks per tunnel, each a power of two: 16 + 4 KiB here, 32 + 4
	// where the opening's depth stayed with the handler's goroutine.
	if per >= 32<<10 {
		t.Errorf("%.1f KiB of goroutine stacks per open tunnel, want under 32 KiB: a tunnel's goroutine kept the stack its opening grew", per/1024)
	}
}

// TestKernelGatewayTunnelStacks is TestKernelSandboxTunnelStacks for the
// edge gateway's kernel TLS tunnels (sandbox_proxy): the goroutine that
// carries a user's tunnel to its end holds the stack the relay needs, not
// the one its user's handshake and its dial to the forwarder (a handshake
// and a preamble's signature) grew. The forwarder behind it is checked the
// same way.
func TestKernelGatewayTunnelStacks(t *testing.T) {
	kerneltest.Require(t)
	const n = 64
	up := forwardtest.NewPacedUpstream(t, 1, time.Hour)
	fwd, gw := gatewayProcessConfig(t, up, true, nil)
	startCaddy(t, gw, "")
	fwdStacks0, fwdG0 := goStacks(t, fwd)
	gwStacks0, gwG0 := goStacks(t, gw)
	var users []*tls.Conn
	defer func() {
		for _, c := range users {
			c.Close()
		}
	}()
	for i := range n {
		c, err := tls.Dial("tcp", gw.addr, &tls.Config{RootCAs: fwd.ca.Pool, ServerName: fmt.Sprintf("sbx-gwstack-%d.sandbox.test", i)})
		if err != nil {
			t.Fatalf("user %d: %v", i, err)
		}
		users = append(users, c)
	}
	waitUntil(t, time.Minute, func() bool { return up.Accepted() == n }, "every tunnel at the upstream")
	for _, side := range []struct {
		name        string
		e           *sandboxEnv
		stacks0, g0 int64
	}{{"gateway", gw, gwStacks0, gwG0}, {"forwarder", fwd, fwdStacks0, fwdG0}} {
		stacks, g := goStacks(t, side.e)
		for deadline := time.Now().Add(30 * time.Second); g-side.g0 != 2*n; stacks, g = goStacks(t, side.e) {
			if time.Now().After(deadline) {
				t.Fatalf("the %s runs %d goroutines more than before %d tunnels, want 2 per tunnel", side.name, g-side.g0, n)
			}
			time.Sleep(20 * time.Millisecond)
		}
		per := float64(stacks-side.stacks0) / n
		t.Logf("%s: %d tunnels, %.1f KiB of goroutine stacks per tunnel", side.name, n, per/1024)
		if per >= 32<<10 {
			t.Errorf("the %s holds %.1f KiB of goroutine stacks per open tunnel, want under 32 KiB: a tunnel's goroutine kept the stack its opening grew", side.name, per/1024)
		}
	}
}

// goStacks reads the goroutine stacks (bytes) and the goroutines of the
// Caddy process behind e's admin endpoint.
func goStacks(t *testing.T, e *sandboxEnv) (stacks, goroutines int64) {
	t.Helper()
	m := e.metrics(t)
	return m["go_memstats_stack_inuse_bytes"], m["go_goroutines"]
}

package caddyktls

import (
	"crypto/tls"
	"fmt"
	"os"
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
// some 11 KiB deep; below that depth the handshake (its certificate
// verification) and the opening (the preamble's check, the target's dial)
// grew it to 32 KiB, which it kept (a goroutine's stack shrinks only while
// it uses less than a quarter of it). Each runs on a goroutine of its own,
// which ends with it. Read from the real binary's own runtime
// (/metrics), so that nothing of this process counts. Kernel only: a
// userspace TLS session's relay grows its stacks itself, in crypto/tls.
func TestKernelSandboxTunnelStacks(t *testing.T) {
	kerneltest.Require(t)
	fixedStackStart(t)
	const n = 64
	// One byte, then nothing until the tunnel ends: both directions wait.
	up := forwardtest.NewPacedUpstream(t, 1, time.Hour)
	e := newSandboxConfig(t, nil)
	startCaddy(t, e, "")
	g0, stacks0 := settledGoroutines(t, e), goStacks(t, e)
	conns := make([]*ktls.Conn, n)
	for i := range conns {
		conns[i] = e.dial(t, fmt.Sprintf("sbx-stack-%d", i%8), up.Addr())
	}
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	checkTunnelStacks(t, "forwarder", e, stacks0, g0, n)
}

// TestKernelGatewayTunnelStacks is TestKernelSandboxTunnelStacks for the
// edge gateway's kernel TLS tunnels (sandbox_proxy): the goroutine that
// carries a user's tunnel to its end holds the stack the relay needs, not
// the one its user's handshake and its dial to the forwarder (a handshake
// and a preamble's signature) grew. The forwarder behind it is checked the
// same way.
func TestKernelGatewayTunnelStacks(t *testing.T) {
	kerneltest.Require(t)
	fixedStackStart(t)
	const n = 64
	up := forwardtest.NewPacedUpstream(t, 1, time.Hour)
	fwd, gw := gatewayProcessConfig(t, up, true, nil)
	startCaddy(t, gw, "")
	fwdG0, fwdStacks0 := settledGoroutines(t, fwd), goStacks(t, fwd)
	gwG0, gwStacks0 := settledGoroutines(t, gw), goStacks(t, gw)
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
	checkTunnelStacks(t, "gateway", gw, gwStacks0, gwG0, n)
	checkTunnelStacks(t, "forwarder", fwd, fwdStacks0, fwdG0, n)
}

// fixedStackStart makes the Caddy processes the test starts begin every
// goroutine on the smallest stack (GODEBUG adaptivestackstart=0), so that
// what their goroutines hold is what they grew to. By default a Go runtime
// starts new goroutines on the average stack its last collection scanned:
// after a collection that met many handshakes in progress, a tunnel's two
// fresh goroutines begin on 16 KiB each, and the figure says nothing of
// what the tunnel kept.
func fixedStackStart(t *testing.T) {
	v := "adaptivestackstart=0"
	if old := os.Getenv("GODEBUG"); old != "" {
		v += "," + old
	}
	t.Setenv("GODEBUG", v)
}

// checkTunnelStacks waits until the Caddy process behind e runs two
// goroutines more than before (g0, goroutines then) for each of its n new
// tunnels, both directions parked in the relay, and fails t unless their
// stacks (against stacks0, goStacks then) come to under 32 KiB per tunnel:
// two stacks, each a power of two, 16 + 4 KiB, against 32 + 4 where a
// tunnel's goroutine kept the stack its opening grew.
func checkTunnelStacks(t *testing.T, name string, e *sandboxEnv, stacks0, g0 int64, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for g := goroutines(t, e); g-g0 != 2*int64(n); g = goroutines(t, e) {
		if time.Now().After(deadline) {
			t.Fatalf("the %s runs %d goroutines more than before %d tunnels, want 2 per tunnel", name, g-g0, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	per := float64(goStacks(t, e)-stacks0) / float64(n)
	t.Logf("%s: %d tunnels, %.1f KiB of goroutine stacks per tunnel", name, n, per/1024)
	if per >= 32<<10 {
		t.Errorf("the %s holds %.1f KiB of goroutine stacks per open tunnel, want under 32 KiB: a tunnel's goroutine kept the stack its opening grew", name, per/1024)
	}
}

// goroutines reads the goroutines of the Caddy process behind e's admin
// endpoint.
func goroutines(t *testing.T, e *sandboxEnv) int64 {
	t.Helper()
	return e.metrics(t)["go_goroutines"]
}

// settledGoroutines reads the goroutines of the Caddy process behind e
// once three reads 100 ms apart agree (for at most 10 s): a process just
// started runs goroutines of its start that end by themselves, and a
// baseline that counted them would miss as many of the tunnels'.
func settledGoroutines(t *testing.T, e *sandboxEnv) int64 {
	t.Helper()
	return heldStill(func() int64 { return goroutines(t, e) }, 100*time.Millisecond, 2, 10*time.Second)
}

// goStacks reads the goroutine stacks (bytes) of the Caddy process behind
// e's admin endpoint after two collections there (the heap profile's
// gc=1): a stack that a goroutine freed while a collection ran counts as
// in use until one ends, and the handshakes' stacks, freed so, would
// count as the tunnels' own.
func goStacks(t *testing.T, e *sandboxEnv) int64 {
	t.Helper()
	for range 2 {
		e.adminBody(t, "/debug/pprof/heap?gc=1")
	}
	return e.metrics(t)["go_memstats_stack_inuse_bytes"]
}

package caddyktls

import (
	"crypto/tls"
	"testing"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// A gateway that keeps a TLS session cache resumes its session on the next
// tunnel, although the policy requires client certificates (Caddy issues
// no tickets there): the resumed handshake restores the verified client,
// so the sandbox handler, which carries no tunnel for an unverified
// client, opens it, and the bytes arrive exactly. In the kernel every
// session, resumed or not, is offloaded and spliced.
func TestSandboxResumption(t *testing.T) { sandboxResumption(t, false) }

func TestKernelSandboxResumption(t *testing.T) {
	kerneltest.Require(t)
	sandboxResumption(t, true)
}

func sandboxResumption(t *testing.T, kernel bool) {
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	cfg := e.tlsConfig(e.client)
	cfg.ClientSessionCache = tls.NewLRUClientSessionCache(4)
	const size = 256 << 10
	splicedSince := dataPathCheck(t, kernel, 3)
	for i, resumed := range []bool{false, true, true} {
		resumedTunnel(t, e, cfg, "sbx-resume", size, uint64(40+i), resumed)
	}
	if spliced := splicedSince(); kernel && spliced != 3*(2*size+3) {
		t.Errorf("%d bytes spliced, want %d", spliced, 3*(2*size+3))
	}
}

// A ticket resumes only under the configuration load that issued it: after
// a reload the gateway's ticket starts a full handshake (the tunnel still
// opens), and the ticket that one issues resumes.
func TestSandboxResumptionScopedToConfigLoad(t *testing.T) {
	e := newSandboxEnv(t, nil)
	cfg := e.tlsConfig(e.client)
	cfg.ClientSessionCache = tls.NewLRUClientSessionCache(4)
	tunnel := func(i int, resumed bool) {
		t.Helper()
		resumedTunnel(t, e, cfg, "sbx-resume-load", 1024, uint64(50+i), resumed)
	}
	tunnel(0, false)
	tunnel(1, true)
	// Caddy skips a load of an unchanged configuration.
	e.route()["handle"].([]any)[0].(map[string]any)["handshake_timeout"] = "3m"
	e.postLoad(t)
	tunnel(2, false)
	tunnel(3, true)
}

// With resumption off the handler behaves as Caddy's own `tls` handler on
// a policy with client authentication: no tickets, full handshakes.
func TestSandboxResumptionOff(t *testing.T) {
	e := newSandboxConfig(t, nil)
	e.route()["handle"].([]any)[0].(map[string]any)["disable_resumption"] = true
	e.start(t)
	cfg := e.tlsConfig(e.client)
	cfg.ClientSessionCache = tls.NewLRUClientSessionCache(4)
	for i := range 2 {
		resumedTunnel(t, e, cfg, "sbx-resume-off", 1024, uint64(60+i), false)
	}
}

// resumedTunnel dials a tunnel for sandbox with the gateway config cfg,
// checks whether its TLS session resumed, and moves size bytes up (seed)
// and size+3 down through it, checked exactly.
func resumedTunnel(t *testing.T, e *sandboxEnv, cfg *tls.Config, sandbox string, size int64, seed uint64, resumed bool) {
	t.Helper()
	up := forwardtest.NewUpstream(t, size+3)
	c := e.dialWith(t, cfg, e.gw.Signer, sandbox, up.Addr())
	if got := c.ConnectionState().DidResume; got != resumed {
		t.Errorf("tunnel (seed %d): resumed %v, want %v", seed, got, resumed)
	}
	n, sum, err := transfer(c, size, seed)
	if err != nil {
		t.Fatalf("tunnel (seed %d): transfer: %v", seed, err)
	}
	checkTunnelTransfer(t, up, size, seed, n, sum)
}

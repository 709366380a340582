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
		up := forwardtest.NewUpstream(t, size+3)
		c := e.dialWith(t, cfg, e.gw.Signer, "sbx-resume", up.Addr())
		if got := c.ConnectionState().DidResume; got != resumed {
			t.Errorf("tunnel %d: resumed %v, want %v", i, got, resumed)
		}
		n, sum, err := transfer(c, size, uint64(40+i))
		if err != nil {
			t.Fatalf("tunnel %d: transfer: %v", i, err)
		}
		checkTunnelTransfer(t, up, size, uint64(40+i), n, sum)
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
		up := forwardtest.NewUpstream(t, 1024+3)
		c := e.dialWith(t, cfg, e.gw.Signer, "sbx-resume-load", up.Addr())
		if got := c.ConnectionState().DidResume; got != resumed {
			t.Errorf("tunnel %d: resumed %v, want %v", i, got, resumed)
		}
		n, sum, err := transfer(c, 1024, uint64(50+i))
		if err != nil {
			t.Fatalf("tunnel %d: transfer: %v", i, err)
		}
		checkTunnelTransfer(t, up, 1024, uint64(50+i), n, sum)
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
		up := forwardtest.NewUpstream(t, 1024+3)
		c := e.dialWith(t, cfg, e.gw.Signer, "sbx-resume-off", up.Addr())
		if c.ConnectionState().DidResume {
			t.Errorf("tunnel %d resumed with disable_resumption", i)
		}
		n, sum, err := transfer(c, 1024, uint64(60+i))
		if err != nil {
			t.Fatalf("tunnel %d: transfer: %v", i, err)
		}
		checkTunnelTransfer(t, up, 1024, uint64(60+i), n, sum)
	}
}

package caddyktls

import (
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

// A tunnel to a sandbox whose target is down wakes it through the control
// plane (with the configured credentials), waits for it, and runs: the
// bytes the gateway sent before the target listened arrive exact, and the
// wake is counted; a wake the control plane refuses refuses the tunnel
// with wake-failed.
func TestSandboxWakeOnConnect(t *testing.T) { sandboxWakeOnConnect(t) }

// TestKernelSandboxWakeOnConnect is TestSandboxWakeOnConnect on kTLS.
func TestKernelSandboxWakeOnConnect(t *testing.T) {
	kerneltest.Require(t)
	sandboxWakeOnConnect(t)
}

func sandboxWakeOnConnect(t *testing.T) {
	t.Setenv("TEST_WAKE_TOKEN", "wake-token")
	target := netip.MustParseAddrPort(loopbackAddr(t)) // nothing listens there until the wake
	woken := make(chan string, 4)
	plane := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer wake-token" {
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		if r.URL.Path == "/refuse" {
			http.Error(w, "no such sandbox", http.StatusNotFound)
			return
		}
		woken <- r.URL.Path
		w.WriteHeader(http.StatusAccepted)
	}))
	t.Cleanup(plane.Close)
	e := newSandboxEnv(t, map[string]any{"wake": map[string]any{
		"url": plane.URL + "/wake", "timeout": "20s",
		"headers": map[string]any{"Authorization": []string{"Bearer {env.TEST_WAKE_TOKEN}"}},
	}})
	m0 := e.metrics(t)
	size := forwardtest.TransferMiB(t, 4) << 20
	done := e.goTransfer(t, "sbx-paused", target, size, 21)
	select {
	case <-woken:
	case <-time.After(30 * time.Second):
		t.Fatal("no wake call")
	}
	time.Sleep(200 * time.Millisecond) // the sandbox resumes a while later
	up := forwardtest.NewUpstreamOn(t, target.String(), size+3)
	r := <-done
	if r.err != nil {
		t.Fatalf("transfer: %v", r.err)
	}
	checkTunnelTransfer(t, up, size, 21, r.n, r.sum)
	m1 := e.metrics(t)
	if got := m1[`caddy_ktls_sandbox_wakes_total{outcome="woken"}`] - m0[`caddy_ktls_sandbox_wakes_total{outcome="woken"}`]; got != 1 {
		t.Errorf("woken wakes moved by %d, want 1", got)
	}
	// A successful wake is logged at INFO, with the sandbox, its target and
	// how long it took.
	if lines := e.logLines(t, forwarder.WokenMsg); len(lines) != 1 || lines[0]["level"] != "info" || lines[0]["sandbox"] != "sbx-paused" ||
		lines[0]["target"] != target.String() || lines[0]["took"].(float64) < 0.2 {
		t.Errorf("woken lines %v: want one INFO naming sbx-paused, its target %s, and took >= 0.2 s", lines, target)
	}

	// The control plane refuses the wake: the tunnel is refused with its
	// reason, nothing dialed.
	e.sandboxHandler()["wake"].(map[string]any)["url"] = plane.URL + "/refuse"
	e.postLoad(t)
	rejected := len(e.logLines(t, rejectedMsg))
	c := e.dial(t, "sbx-gone", netip.MustParseAddrPort(loopbackAddr(t)))
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Errorf("refused tunnel read %d bytes, %v", n, err)
	}
	c.Close()
	if line := e.waitLogLine(t, rejectedMsg, rejected); line["reason"] != "wake-failed" {
		t.Errorf("rejection %v, want reason wake-failed", line)
	}
}

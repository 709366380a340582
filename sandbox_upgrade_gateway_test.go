package caddyktls

import (
	"crypto/tls"
	"fmt"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// A binary upgrade of an edge gateway with the real binary: a gateway
// Caddy (layer4: ktls, then sandbox_proxy to a forwarder Caddy) carries
// tunnels streaming both ways; a second gateway process started with the
// same configuration takes them over, and the old one exits.

// TestKernelUpgradeMovesGatewayTunnels: every tunnel (kernel TLS on both
// of the gateway's sessions), opened before a reload, moves to the new
// gateway process mid-stream,
// arrives exact both ways, and ends there, counted there; no record fails
// to decrypt anywhere.
func TestKernelUpgradeMovesGatewayTunnels(t *testing.T) {
	kerneltest.Require(t)
	gatewayUpgrade(t, true)
}

// TestUpgradeGatewayUserspaceTunnelsStay: tunnels whose user session runs
// in userspace TLS (offload off at the gateway) cannot move: the handoff
// counts them as staying, the new process serves the next tunnels, and
// the old one drains the ones that stayed (drain_grace_period): they run
// on exact both ways to their orderly end before it exits.
func TestUpgradeGatewayUserspaceTunnelsStay(t *testing.T) {
	if kerneltest.Required() {
		t.Skip("the kernel variant is TestKernelUpgradeMovesGatewayTunnels")
	}
	gatewayUpgrade(t, false)
}

// TestUpgradeGatewayServesConnectionsAcceptedBefore: a user connection the
// old gateway process accepted before the switch, still in its TLS
// handshake when the handoff ended (it outlasts the settle step), is
// served there to its end: its tunnel is dialed in the old process, where
// the drain used to refuse it or the exit cut it, and carried exact both
// ways; the old process exits once it ended.
func TestUpgradeGatewayServesConnectionsAcceptedBefore(t *testing.T) {
	if kerneltest.Required() {
		t.Skip("the same on every kernel: a host test")
	}
	const chunk, pace = 4 << 10, 20 * time.Millisecond
	up := forwardtest.NewPacedUpstream(t, chunk, pace)
	fwd, gw := gatewayProcessConfig(t, up, false, map[string]any{"drain_grace_period": "5m"})
	// The handshake held outlasts the old process's settle step (10 s)
	// and the waits before the handoff (up to 1 minute for it to be held,
	// 2 for the new process to start), and the grace period the call after
	// it: on a busy host the new process's start alone took over a minute.
	layer4Server(gw.cfg, "tunnels")["routes"].([]any)[0].(map[string]any)["handle"].([]any)[0].(map[string]any)["handshake_timeout"] = "5m"
	handoffConfig(gw, filepath.Join(t.TempDir(), "handoff.sock"))
	old := startCaddy(t, gw, "")

	// No byte: the old process's handshake waits for the ClientHello.
	hold, err := net.Dial("tcp", gw.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hold.Close() })
	waitUntil(t, time.Minute, func() bool { return gw.metric(t, "caddy_ktls_handshakes_in_progress") == 1 }, "the held connection in its handshake")

	_, took, handed := upgradeProcess(t, gw, 2*time.Minute)
	stop := make(chan struct{})
	c := tls.Client(hold, &tls.Config{RootCAs: fwd.ca.Pool, ServerName: "sbx-gwheld.sandbox.test"})
	c.SetDeadline(time.Now().Add(time.Minute))
	if err := c.Handshake(); err != nil {
		t.Fatalf("the handshake with the old process after the handoff: %v", err)
	}
	c.SetDeadline(time.Time{})
	stream := pacedStream(c, 811, chunk, pace, stop)
	waitUntil(t, time.Minute, func() bool { return up.Accepted() == 1 && up.Received() >= 4*chunk }, "the held connection's bytes at the upstream")
	close(stop)
	o := <-stream
	select {
	case <-old.exited:
		if old.exitErr != nil {
			t.Errorf("the old process exited with %v", old.exitErr)
		}
	case <-time.After(time.Minute):
		t.Fatal("the old process did not exit once the connection it accepted before the handoff ended")
	}
	up.Close()
	if o.err != nil || !exactAtUpstream(o, up.Results()) || o.recv == 0 {
		t.Errorf("the held connection (sent %d, received %d, %v): not carried exact both ways", o.sent, o.recv, o.err)
	}
	serving := gw.waitLogLine(t, "serving the connections accepted before the handoff to their end: their tunnels open here; this process exits once it holds none, or when the grace period ends", 0)
	if serving["connections"] != 1.0 {
		t.Errorf("the old process serves %v connections accepted before the handoff; want 1", serving["connections"])
	}
	gw.waitLogLine(t, "served every connection accepted before the handoff", 0)
	t.Logf("old process: %v; new process: %v", handed, took)
}

func gatewayUpgrade(t *testing.T, kernel bool) {
	const n, chunk, pace = 4, 4 << 10, 20 * time.Millisecond
	up := forwardtest.NewPacedUpstream(t, chunk, pace)
	// The tunnels that stay in userspace TLS drain in the old process: the
	// grace period outlasts the test's streams.
	fwd, gw := gatewayProcessConfig(t, up, kernel, map[string]any{"drain_grace_period": "2m"})
	handoffConfig(gw, filepath.Join(t.TempDir(), "handoff.sock"))
	old := startCaddy(t, gw, "")

	var before kerneltest.Stat
	if kernel {
		var err error
		if before, err = kerneltest.ReadStat(); err != nil {
			t.Fatal(err)
		}
	}
	stop := make(chan struct{})
	var streams []<-chan streamOutcome
	for i := range n {
		c, err := tls.Dial("tcp", gw.addr, &tls.Config{RootCAs: fwd.ca.Pool, ServerName: fmt.Sprintf("sbx-gwup-%d.sandbox.test", i)})
		if err != nil {
			t.Fatalf("user %d: %v", i, err)
		}
		streams = append(streams, pacedStream(c, uint64(700+i), chunk, pace, stop))
	}
	waitUntil(t, time.Minute, func() bool { return up.Accepted() == n && up.Received() >= int64(n*chunk) },
		"every tunnel's first bytes at the upstream")
	// A reload to another sandbox_proxy configuration: the tunnels run on in
	// the handler it replaced, and move all the same, into the new
	// configuration's only handler (whose move name is another).
	layer4Server(gw.cfg, "tunnels")["routes"].([]any)[0].(map[string]any)["handle"].([]any)[1].(map[string]any)["dial_timeout"] = "11s"
	gw.postLoad(t)

	nu, took, handed := upgradeProcess(t, gw, 2*time.Minute)
	moved, _ := handed["gateway_moved"].(float64)
	stayed, _ := handed["gateway_stayed"].(map[string]any)
	if took["gateway_tunnels"] != moved || handed["moved"] != 0.0 || took["tunnels"] != 0.0 ||
		(kernel && (moved != n || len(stayed) != 0)) || (!kernel && (moved != 0 || stayedCount(stayed) != n)) {
		t.Errorf("the new process took %v gateway tunnels (and %v forwarder tunnels), the old one handed %v over (%v stayed, %v forwarder tunnels); "+
			"want the same, all %d in kernel TLS, none in userspace TLS (%d stay)", took["gateway_tunnels"], took["tunnels"], handed["gateway_moved"], stayed, handed["moved"], n, n)
	}
	if kernel {
		// The moved tunnels stream on in the new process.
		at := up.Received()
		waitUntil(t, time.Minute, func() bool { return up.Received() >= at+int64(n*chunk) }, "bytes through the moved tunnels")
		if lines := gw.logLines(t, "sandbox_proxy: tunnel moved to the new process"); len(lines) != 0 && len(lines) != n {
			t.Errorf("the old process logged %d tunnels moved, want %d (or none: DEBUG)", len(lines), n)
		}
	}
	close(stop)
	select {
	case <-old.exited:
		if old.exitErr != nil {
			t.Errorf("the old process exited with %v", old.exitErr)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the old process did not exit after the handoff")
	}
	var outcomes []streamOutcome
	for _, s := range streams {
		outcomes = append(outcomes, <-s)
	}
	// The new process serves a tunnel opened after the old one exited.
	last := make(chan struct{})
	c, err := tls.Dial("tcp", gw.addr, &tls.Config{RootCAs: fwd.ca.Pool, ServerName: "sbx-gwup-after.sandbox.test"})
	if err != nil {
		t.Fatalf("a user after the upgrade: %v", err)
	}
	after := pacedStream(c, 799, chunk, pace, last)
	waitUntil(t, time.Minute, func() bool { return up.Accepted() == n+1 }, "the tunnel after the upgrade at the upstream")
	close(last)
	outcomes = append(outcomes, <-after)
	up.Close()
	// Moved or stayed (then drained in the old process), every tunnel ran
	// to its orderly end.
	for i, o := range outcomes {
		if o.err != nil || !exactAtUpstream(o, up.Results()) || o.recv == 0 {
			t.Errorf("tunnel %d (sent %d, received %d, %v): not carried exact both ways through the upgrade", i, o.sent, o.recv, o.err)
		}
	}
	if lines := gw.logLines(t, "closed tunnels still open after the drain grace period"); len(lines) != 0 {
		t.Errorf("the old process closed tunnels at its drain's deadline: %v", lines)
	}
	if kernel {
		// The moved tunnels ended in the new process, counted there once
		// each (with the one opened after): not as an end in the old one.
		waitUntil(t, 30*time.Second, func() bool { return nu.metric(t, gatewayEndsSeries("closed")) == n+1 }, "the new process to count the tunnels closed")
		if m := nu.metrics(t); m[gatewayEndsSeries("failed")] != 0 || m[`caddy_ktls_sandbox_handoff_tunnels_total{result="adopted"}`] != n {
			t.Errorf("the new process: %d tunnels failed, %d adopted; want 0 and %d", m[gatewayEndsSeries("failed")], m[`caddy_ktls_sandbox_handoff_tunnels_total{result="adopted"}`], n)
		}
		after, err := kerneltest.ReadStat()
		if err != nil {
			t.Fatal(err)
		}
		if d := after["TlsDecryptError"] - before["TlsDecryptError"]; d != 0 {
			t.Errorf("tls_stat TlsDecryptError %+d through the upgrade", d)
		}
	}
	t.Logf("old process: %v; new process: %v", handed, took)
}

// gatewayProcessConfig starts a forwarder Caddy and returns it with the
// configuration, not started, of a gateway Caddy (layer4: ktls, with its
// offload on only for kernel, then sandbox_proxy to the forwarder, for the
// sandbox named by the server name's third label from the right, to up);
// proxyOpts are merged into the sandbox_proxy handler's JSON.
func gatewayProcessConfig(t *testing.T, up *forwardtest.Upstream, kernel bool, proxyOpts map[string]any) (fwd, gw *sandboxEnv) {
	t.Helper()
	fwd = newSandboxConfig(t, nil)
	files := addGatewaySide(t, fwd)
	startCaddy(t, fwd, "")

	gw = &sandboxEnv{ca: fwd.ca, addr: loopbackAddr(t), adminAddr: loopbackAddr(t), logFile: filepath.Join(t.TempDir(), "gateway.log")}
	proxy := files.dialJSON()
	proxy["handler"], proxy["forwarder"], proxy["sandbox"], proxy["target"] = "sandbox_proxy", fwd.addr, "{l4.tls.server_name.labels.2}", up.Addr().String()
	for k, v := range proxyOpts {
		proxy[k] = v
	}
	userSide := map[string]any{"handler": "ktls"}
	if !kernel {
		userSide["disable_offload"] = true
	}
	gw.cfg = cloneJSON(t, map[string]any{
		"admin":   map[string]any{"listen": gw.adminAddr, "config": map[string]any{"persist": false}},
		"logging": fwd.cfg["logging"],
		"apps": map[string]any{
			"tls": fwd.cfg["apps"].(map[string]any)["tls"],
			"layer4": map[string]any{"servers": map[string]any{"tunnels": map[string]any{
				"listen": []string{gw.addr},
				"routes": []any{map[string]any{"handle": []any{userSide, proxy}}},
			}}},
		},
	})
	gw.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["writer"].(map[string]any)["filename"] = gw.logFile
	return fwd, gw
}

// stayedCount sums a handoff log line's stayed counts by why.
func stayedCount(stayed map[string]any) int {
	sum := 0
	for _, v := range stayed {
		f, _ := v.(float64)
		sum += int(f)
	}
	return sum
}

package caddyktls

import (
	"fmt"
	"io"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
)

func TestSandboxEndToEnd(t *testing.T) {
	size := forwardtest.TransferMiB(t, 64) << 20
	up := forwardtest.NewUpstream(t, size+3)
	e := newSandboxEnv(t, nil)
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	to0, from0 := forwarder.Tunnels().Totals()
	before := activityOf(t, e, "sbx-e2e")

	n, recvSum, err := transfer(e.dial(t, "sbx-e2e", up.Addr()), size, 7)
	if err != nil {
		t.Fatalf("transfer: %v", err)
	}
	checkTunnelTransfer(t, up, size, 7, n, recvSum)
	to1, from1 := forwarder.Tunnels().Totals()
	if to1-to0 != size || from1-from0 != size+3 {
		t.Errorf("registry meters moved %d/%d, want %d/%d", to1-to0, from1-from0, size, size+3)
	}
	after := activityOf(t, e, "sbx-e2e")
	if after.BytesToSandbox-before.BytesToSandbox != size || after.BytesFromSandbox-before.BytesFromSandbox != size+3 ||
		after.TotalTunnels-before.TotalTunnels != 1 || after.OpenTunnels != 0 {
		t.Errorf("GET /sandbox/activity: before %+v after %+v", before, after)
	}
}

// The /metrics series of the tunnel registry.
const (
	tunnelsActiveSeries = "caddy_ktls_sandbox_tunnels_active"
	tunnelsTotalSeries  = "caddy_ktls_sandbox_tunnels_total"
	toSandboxSeries     = `caddy_ktls_sandbox_bytes_total{direction="to_sandbox"}`
	fromSandboxSeries   = `caddy_ktls_sandbox_bytes_total{direction="from_sandbox"}`
	splicedSeries       = `caddy_ktls_relay_bytes_total{path="splice"}`
	copiedSeries        = `caddy_ktls_relay_bytes_total{path="copy"}`
)

// An open tunnel is visible while it runs: GET /sandbox/tunnels lists it
// with its sandbox, target, peer, the exact bytes moved each way and its
// opened and last-activity times (the latter advancing as bytes move), GET
// /sandbox/activity has its sandbox's totals, /metrics counts it active.
// An admin-API reload in the middle resets none of it: the same tunnel
// keeps counting. Once it ended, every counter has moved by exactly the
// bytes moved, under the data path that moved them (copy without kTLS).
func TestSandboxTunnelObservability(t *testing.T) { sandboxTunnelObservability(t, false) }

// TestKernelSandboxTunnelObservability is TestSandboxTunnelObservability on
// a kTLS kernel, where every byte is counted as spliced.
func TestKernelSandboxTunnelObservability(t *testing.T) {
	kerneltest.Require(t)
	sandboxTunnelObservability(t, true)
}

func sandboxTunnelObservability(t *testing.T, kernel bool) {
	const reply, first, second = 48 << 10, 32 << 10, 16 << 10
	up := forwardtest.NewUpstream(t, reply) // sends its reply at once, then reads to the end
	sandbox := uniqueSandbox("sbx-observed")
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	waitIdle(t) // the active gauge starts at 0
	metrics0 := e.metrics(t)
	checkDataPath := dataPathCheck(t, kernel, 1)
	start := time.Now()
	c := e.dial(t, sandbox, up.Addr())
	defer c.Close()
	src := forwardtest.NewPattern(12)
	send := func(n int64) {
		t.Helper()
		if _, err := io.Copy(c, io.LimitReader(src, n)); err != nil {
			t.Fatalf("gateway write: %v", err)
		}
	}
	// While open, the relay bytes (counted per closed tunnel) stay put.
	whileOpen := func(to int64) map[string]int64 {
		return map[string]int64{tunnelsActiveSeries: 1, tunnelsTotalSeries: 1, toSandboxSeries: to, fromSandboxSeries: reply,
			splicedSeries: 0, copiedSeries: 0}
	}

	send(first)
	if _, err := io.ReadFull(c, make([]byte, reply)); err != nil {
		t.Fatalf("gateway read: %v", err)
	}
	opened := e.waitTunnel(t, sandbox, first, reply)
	if opened.Target != up.Addr().String() || opened.Peer != c.LocalAddr().String() || opened.Certificate != gatewaySubject || opened.KeyID != gatewayKeyID ||
		opened.Opened.Before(start) || opened.Opened.After(time.Now()) || opened.LastActivity.Before(opened.Opened) {
		t.Errorf("GET /sandbox/tunnels: %+v; want target %s, peer %s, client certificate %s, key %s, opened after %v, last activity since",
			opened, up.Addr(), c.LocalAddr(), gatewaySubject, gatewayKeyID, start)
	}
	if a := activityOf(t, e, sandbox); a != (sandboxTotals{Sandbox: sandbox, BytesToSandbox: first, BytesFromSandbox: reply, OpenTunnels: 1, TotalTunnels: 1}) {
		t.Errorf("GET /sandbox/activity while open: %+v", a)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), whileOpen(first))

	e.sandboxHandler()["preamble_timeout"] = "4s" // a changed configuration
	e.postLoad(t)
	send(second)
	moved := e.waitTunnel(t, sandbox, first+second, reply)
	if moved.ID != opened.ID || !moved.Opened.Equal(opened.Opened) || !moved.LastActivity.After(opened.LastActivity) {
		t.Errorf("after the reload and %d more bytes: %+v; want tunnel %d, opened %v, last activity after %v",
			second, moved, opened.ID, opened.Opened, opened.LastActivity)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), whileOpen(first+second))

	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
		t.Errorf("gateway read %d bytes more (err %v), want the end", n, err)
	}
	waitIdle(t)
	checkDataPath()
	up.Close()
	if r := up.Results()[0]; r.Received != first+second || r.RecvSum != forwardtest.PatternSum(12, first+second) {
		t.Errorf("upstream received %d bytes, want the gateway's %d", r.Received, first+second)
	}
	spliced, copied := int64(0), int64(first+second+reply)
	if kernel {
		spliced, copied = copied, 0
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{tunnelsActiveSeries: 0, tunnelsTotalSeries: 1,
		toSandboxSeries: first + second, fromSandboxSeries: reply, splicedSeries: spliced, copiedSeries: copied})
	if a := activityOf(t, e, sandbox); a != (sandboxTotals{Sandbox: sandbox, BytesToSandbox: first + second, BytesFromSandbox: reply, TotalTunnels: 1}) {
		t.Errorf("GET /sandbox/activity after the end: %+v", a)
	}
}

// Many tunnels open at once, of mixed sizes both ways (zero included), with
// half-close each way: every tunnel's bytes arrive unchanged both ways
// (SHA-256 per tunnel) and the registry counts exactly the bytes moved.
func TestSandboxConcurrentTunnels(t *testing.T) { sandboxConcurrentTunnels(t, false) }

// TestKernelSandboxConcurrentTunnels is TestSandboxConcurrentTunnels on a
// kTLS kernel, as many tunnels at a quarter of the size: every byte of
// every tunnel must be spliced. The VM's one vCPU emulates AES for the
// gateways' Go TLS too; at full size a loaded host starved a gateway's
// goroutine past crypto/tls's 5 s close_notify deadline.
func TestKernelSandboxConcurrentTunnels(t *testing.T) {
	kerneltest.Require(t)
	sandboxConcurrentTunnels(t, true)
}

func sandboxConcurrentTunnels(t *testing.T, kernel bool) {
	const tunnelsN = 200
	unit := int64(1 << 10)
	if kernel {
		unit /= 4
	}
	// No two tunnels carry the same stream: the sizes differ (0 to ~220
	// KiB each way on the host), and so do the clients' and the
	// upstream's seeds. Tunnel 0 sends nothing, and the first connection
	// the upstream accepts replies nothing: their half-close is the first
	// thing sent.
	send := func(i int) int64 { return int64(i%7)*37*unit + int64(i) }
	up := forwardtest.NewSizedUpstream(t, func(conn int) int64 { return int64(conn%5)*53*unit + int64(3*conn) })
	e := newSandboxEnv(t, nil)
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	to0, from0 := forwarder.Tunnels().Totals()
	splicedSince := dataPathCheck(t, kernel, int64(tunnelsN))
	// Every tunnel is open before any of them sends a byte: they all run at
	// once. (Dialed in turn: the handshakes are not what is tested.)
	conns := make([]*ktls.Conn, tunnelsN)
	for i := range conns {
		conns[i] = e.dial(t, fmt.Sprintf("sbx-%d", i%10), up.Addr())
	}
	waitUntil(t, 30*time.Second, func() bool { open, _ := forwarder.Tunnels().Counts(); return open == tunnelsN },
		fmt.Sprintf("all %d tunnels to be open at once", tunnelsN))
	outcomes := make([]streamOutcome, tunnelsN)
	// Every tunnel stays open throughout; at most 50 gateways move bytes at
	// once. Their userspace TLS shares this process's CPUs (one emulated
	// CPU in the VM; -race beside a loaded host), and a gateway goroutine
	// starved for 5 s misses crypto/tls's deadline for its close_notify (an
	// i/o timeout, not a forwarder fault).
	moving := make(chan struct{}, 50)
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			moving <- struct{}{}
			defer func() { <-moving }()
			o := &outcomes[i]
			o.sent, o.sentSum = send(i), forwardtest.PatternSum(uint64(i), send(i))
			o.recv, o.recvSum, o.err = transfer(c, o.sent, uint64(i))
		})
	}
	wg.Wait()
	var sent, received int64
	for i, o := range outcomes {
		if o.err != nil {
			t.Errorf("tunnel %d: %v", i, o.err)
		}
		sent, received = sent+o.sent, received+o.recv
	}
	waitIdle(t)
	spliced := splicedSince()
	up.Close()
	if n := len(up.Results()); n != tunnelsN {
		t.Errorf("upstream served %d connections, want %d", n, tunnelsN)
	}
	checkBothWays(t, up, outcomes)
	if to1, from1 := forwarder.Tunnels().Totals(); to1-to0 != sent || from1-from0 != received {
		t.Errorf("registry meters moved %d/%d, want %d/%d", to1-to0, from1-from0, sent, received)
	}
	if kernel && spliced != sent+received {
		t.Errorf("%d bytes spliced, want all %d the tunnels moved", spliced, sent+received)
	}
}

// TestKernelSandboxEndToEnd is TestSandboxEndToEnd on a kTLS kernel: the
// kernel must carry the TLS records (tls_stat) and every byte of both
// directions must move by splice(2), none through userspace.
func TestKernelSandboxEndToEnd(t *testing.T) {
	kerneltest.Require(t)
	size := forwardtest.TransferMiB(t, 4) << 20
	up := forwardtest.NewUpstream(t, size)
	e := newSandboxEnv(t, nil)
	// After Caddy started: what Caddy itself keeps (logs, admin) is not a
	// tunnel leak; everything the tunnels open must be gone again.
	forwardtest.CheckLeaks(t)
	splicedSince := dataPathCheck(t, true, 1)
	n, sum, err := transfer(e.dial(t, "sbx-kernel", up.Addr()), size, 11)
	if err != nil {
		t.Errorf("transfer: %v", err)
	}
	waitIdle(t)
	spliced := splicedSince()
	up.Close()
	r := up.Results()[0]
	if r.Received != size || r.RecvSum != forwardtest.PatternSum(11, size) || n != size || sum != r.SentSum {
		t.Fatalf("bytes: upstream got %d, client got %d of %d; hashes match: %v %v", r.Received, n, size,
			r.RecvSum == forwardtest.PatternSum(11, size), sum == r.SentSum)
	}
	if spliced != 2*size {
		t.Errorf("%d bytes spliced, want %d", spliced, 2*size)
	}
	t.Logf("moved %d MiB each way", size>>20)
}

// The sandbox matcher shares a port between tunnels and other traffic. It
// reads plaintext, so it runs after `ktls`, in a subroute: the route shape
// is `ktls` then `subroute { @t sandbox -> sandbox; anything else -> ... }`
// (here caddy-l4's echo handler). Non-tunnel traffic is not a rejection.
func TestSandboxMatcherSharesPort(t *testing.T) {
	up := forwardtest.NewUpstream(t, 100<<10)
	e := newSandboxConfig(t, nil)
	route := e.route()
	handlers := route["handle"].([]any)
	route["handle"] = []any{handlers[0], map[string]any{
		"handler": "subroute",
		"routes": []any{
			map[string]any{"match": []any{map[string]any{"sandbox": map[string]any{}}}, "handle": []any{handlers[1]}},
			map[string]any{"handle": []any{map[string]any{"handler": "echo"}}},
		},
	}}
	e.start(t)
	forwardtest.CheckLeaks(t)
	rejected := forwarder.Tunnels().RefusedTunnels()

	n, sum, err := transfer(e.dial(t, "sbx-matcher", up.Addr()), 3000, 8)
	if err != nil || n != 100<<10 || sum != forwardtest.PatternSum(2, 100<<10) {
		t.Errorf("tunnel through the matcher: %d bytes, err %v", n, err)
	}
	const hello = "GET / HTTP/1.0\r\n\r\nnot a tunnel"
	c := e.rawTunnel(t, []byte(hello), true)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	echo, err := io.ReadAll(c)
	c.Close()
	if string(echo) != hello || err != nil {
		t.Errorf("the other route echoed %q (err %v), want %q", echo, err, hello)
	}
	waitIdle(t)
	up.Close()
	if r := up.Results(); len(r) != 1 || r[0].Received != 3000 || r[0].RecvSum != forwardtest.PatternSum(8, 3000) {
		t.Errorf("upstream results %+v, want one connection with the tunnel's 3000 bytes", r)
	}
	if now := forwarder.Tunnels().RefusedTunnels(); !maps.Equal(now, rejected) {
		t.Errorf("rejections changed from %v to %v: non-tunnel traffic reached the sandbox handler", rejected, now)
	}
}

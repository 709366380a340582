package caddyktls

import (
	"encoding/base64"
	"fmt"
	"io"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// A reload that stops trusting a gateway key ends that key's open tunnels
// as failures, logged with the reason and counted, while the tunnels of the
// keys it still trusts keep moving; the retired key's new tunnels are
// refused (unknown-key).
func TestSandboxReloadRevokesKey(t *testing.T) { sandboxReloadRevokesKey(t, false) }

// TestKernelSandboxReloadRevokesKey is TestSandboxReloadRevokesKey on a
// kTLS kernel, where the revoked tunnel's gateway reads internal_error.
func TestKernelSandboxReloadRevokesKey(t *testing.T) {
	kerneltest.Require(t)
	sandboxReloadRevokesKey(t, true)
}

func sandboxReloadRevokesKey(t *testing.T, kernel bool) {
	target := tricklingUpstream(t, 1<<10, 20*time.Millisecond)
	retired := forwardtest.NewGateway(t, "gw-retired")
	e := newSandboxConfig(t, nil)
	trusted := e.sandboxHandler()["keys"].([]any)
	e.sandboxHandler()["keys"] = append(trusted, map[string]any{"id": "gw-retired", "public_key": base64.StdEncoding.EncodeToString(retired.Pub)})
	e.start(t)
	forwardtest.CheckLeaks(t)
	revoked0 := forwarder.Tunnels().Revoked()
	metrics0 := e.metrics(t)
	dial := func(signer *preamble.Signer) *ktls.Conn {
		t.Helper()
		return e.dialWith(t, e.tlsConfig(e.client), signer, uniqueSandbox("sbx-revoke"), target)
	}
	keptConn, goneConn := dial(e.gw.Signer), dial(retired.Signer)
	defer keptConn.Close()
	defer goneConn.Close()
	kept, gone := readTunnel(keptConn), readTunnel(goneConn)
	waitUntil(t, 10*time.Second, func() bool { return kept.n.Load() > 0 && gone.n.Load() > 0 }, "both tunnels to move bytes")

	e.sandboxHandler()["keys"] = trusted
	e.postLoad(t)
	select {
	case err := <-gone.end:
		checkGatewayEnd(t, err, kernel, false)
	case <-time.After(10 * time.Second):
		t.Fatal("the retired key's tunnel is still open after the reload")
	}
	l := e.waitLogLine(t, "sandbox tunnel ended with an error", 0)
	if l["key_id"] != "gw-retired" || !strings.Contains(fmt.Sprint(l["error"]), "the key gw-retired that signed the tunnel's preamble is no longer trusted") {
		t.Errorf("log line %v, want the retired key named as the end", l)
	}
	if w := e.logLines(t, "closed open tunnels whose signing key no loaded configuration trusts any more"); len(w) != 1 || w[0]["tunnels"] != 1.0 {
		t.Errorf("WARN lines %v, want one closing 1 tunnel", w)
	}
	if n := forwarder.Tunnels().Revoked() - revoked0; n != 1 {
		t.Errorf("%d tunnels counted as revoked, want 1", n)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{"caddy_ktls_sandbox_tunnels_revoked_total": 1})
	// The trusted key's tunnel went on through the reload.
	at := kept.n.Load()
	waitUntil(t, 10*time.Second, func() bool { return kept.n.Load() > at }, "the trusted key's tunnel to keep moving after the reload")
	select {
	case err := <-kept.end:
		t.Fatalf("the trusted key's tunnel ended: %v", err)
	default:
	}
	// The retired key opens no new tunnel.
	before := forwarder.Tunnels().RefusedTunnels()[string(preamble.ReasonUnknownKey)]
	c := dial(retired.Signer)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, c); n != 0 {
		t.Errorf("a tunnel signed by the retired key read %d bytes", n)
	} else {
		checkGatewayEnd(t, err, kernel, true)
	}
	c.Close()
	waitRejections(t, string(preamble.ReasonUnknownKey), before+1)
	keptConn.Close()
	waitIdle(t)
}

// Tunnels outlive configuration reloads: POST /load with a changed config
// while every tunnel streams both ways (both ends keep writing until after
// the last reload); none drops, bytes move across every reload and every
// tunnel moves more after the last one, each tunnel's bytes arrive
// unchanged both ways (SHA-256), the new configs keep accepting tunnels,
// and fds, goroutines and heap come back to where they were.
// KTLS_LOAD_TUNNELS and KTLS_LOAD_RELOADS size it (default 50 tunnels, 20
// reloads; the full-size run of issue 8 is 1000 and 100).
func TestSandboxReloadsKeepTunnels(t *testing.T) { sandboxReloadsKeepTunnels(t, false) }

// TestKernelSandboxReloadsKeepTunnels is TestSandboxReloadsKeepTunnels on a
// kTLS kernel, with fewer tunnels and a slower stream (the VM's AES is
// slow): the spliced tunnels outlive the reloads and none of their bytes is
// copied.
func TestKernelSandboxReloadsKeepTunnels(t *testing.T) {
	kerneltest.Require(t)
	sandboxReloadsKeepTunnels(t, true)
}

func sandboxReloadsKeepTunnels(t *testing.T, kernel bool) {
	tunnelsN, reloadsN := kerneltest.PositiveEnv(t, "KTLS_LOAD_TUNNELS", 50), kerneltest.PositiveEnv(t, "KTLS_LOAD_RELOADS", 20)
	// Each client and each upstream connection writes chunk bytes every
	// pace, the client until the reloads are done, the upstream until its
	// client half-closes; pace grows with the number of tunnels so that all
	// of them together move about 1 MB/s each way. (Four times that leaves
	// the reloads starved of CPU under -race: userspace TLS on the host.)
	// In the VM, whose AES is emulated, fewer tunnels and a slower stream
	// keep the bytes moved small.
	chunk, pace := 4<<10, time.Duration(tunnelsN)*4*time.Millisecond
	if kernel {
		tunnelsN = kerneltest.PositiveEnv(t, "KTLS_LOAD_TUNNELS", 8)
		pace = time.Duration(tunnelsN) * 12500 * time.Microsecond
	}
	// Per tunnel, this process holds four sockets (gateway, forwarder's two,
	// upstream) and, while both directions are mid-burst, two pipes.
	needFDs(t, uint64(8*tunnelsN+256))
	up := forwardtest.NewPacedUpstream(t, chunk, pace)
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	heapBefore, fdsBefore := liveHeap(), kerneltest.OpenFDs(t)
	start := time.Now()
	splicedSince := dataPathCheck(t, kernel, int64(tunnelsN)+1)
	// A failed run still ends the streams, or the upstream's cleanup waits
	// for them forever.
	stop := make(chan struct{})
	stopOnce := sync.OnceFunc(func() { close(stop) })
	t.Cleanup(stopOnce)
	var results []<-chan streamOutcome
	for i := range tunnelsN {
		c := e.dial(t, fmt.Sprintf("sbx-reload-%d", i), up.Addr())
		results = append(results, pacedStream(c, uint64(100+i), chunk, pace, stop))
	}
	// Every tunnel open and streaming both ways: each reload must find them
	// all open, mid-stream.
	waitStreaming(t, tunnelsN, nil, "every tunnel to move bytes both ways before the reloads")
	sandbox := e.sandboxHandler()
	reloadsStart := time.Now()
	for i := range reloadsN {
		to0, from0 := forwarder.Tunnels().Totals()
		sandbox["preamble_timeout"] = fmt.Sprintf("%dms", 5000+i)
		e.postLoad(t)
		if open, _ := forwarder.Tunnels().Counts(); open != tunnelsN {
			t.Fatalf("after reload %d: %d tunnels open, want %d", i, open, tunnelsN)
		}
		// The next reload only once bytes moved both ways since this one
		// began: every reload happens while data flows.
		waitUntil(t, 60*time.Second, func() bool {
			to, from := forwarder.Tunnels().Totals()
			return to > to0 && from > from0
		}, fmt.Sprintf("bytes to move both ways across reload %d", i))
	}
	t.Logf("%d reloads took %v", reloadsN, time.Since(reloadsStart))
	// Every tunnel, not only some, is still streaming both ways.
	waitStreaming(t, tunnelsN, tunnelCounters(), "every tunnel to move bytes both ways after the last reload")
	// The last configuration carries new tunnels too.
	after := streamOutcome{sent: 1000, sentSum: forwardtest.PatternSum(5, 1000)}
	after.recv, after.recvSum, after.err = transfer(e.dial(t, "sbx-after-reload", up.Addr()), after.sent, 5)
	stopOnce()
	outcomes := []streamOutcome{after}
	var moved int64
	for _, r := range results {
		outcomes = append(outcomes, <-r)
	}
	for i, o := range outcomes {
		if o.err != nil {
			t.Errorf("tunnel %d (0: after the reloads): %v", i, o.err)
		}
		moved += o.sent + o.recv
	}
	waitIdle(t)
	if spliced := splicedSince(); kernel && spliced != moved {
		t.Errorf("%d bytes spliced, want all %d the tunnels moved", spliced, moved)
	}
	up.Close()
	if n := len(up.Results()); n != tunnelsN+1 {
		t.Errorf("upstream served %d connections, want %d", n, tunnelsN+1)
	}
	verified := checkBothWays(t, up, outcomes)
	heapAfter, fdsAfter := liveHeap(), kerneltest.OpenFDs(t)
	t.Logf("%d tunnels, %d reloads, %d of %d bytes verified (SHA-256 both ways), %v; live heap %d KiB before, %d KiB after; "+
		"fds %d before, %d after (%d idle pipes in the pool)", tunnelsN, reloadsN, verified, moved, time.Since(start).Round(time.Millisecond),
		heapBefore>>10, heapAfter>>10, fdsBefore, fdsAfter, splice.DefaultPipePool().Stats().Idle)
	if heapAfter > heapBefore+16<<20 {
		t.Errorf("live heap grew from %d KiB to %d KiB over the run", heapBefore>>10, heapAfter>>10)
	}
}

// tunnelCounters returns the registry's open tunnels by sandbox ID.
func tunnelCounters() map[string]forward.TunnelInfo {
	m := map[string]forward.TunnelInfo{}
	for _, ti := range forwarder.Tunnels().Tunnels() {
		m[ti.Sandbox] = ti
	}
	return m
}

// waitStreaming waits until exactly n tunnels are open and each has moved
// more bytes both ways than its entry in since (absent: none), or fails t
// naming what it waited for.
func waitStreaming(t testing.TB, n int, since map[string]forward.TunnelInfo, what string) {
	t.Helper()
	waitUntil(t, 60*time.Second, func() bool {
		now := tunnelCounters()
		if len(now) != n {
			return false
		}
		for sb, ti := range now {
			if prev := since[sb]; ti.BytesToSandbox <= prev.BytesToSandbox || ti.BytesFromSandbox <= prev.BytesFromSandbox {
				return false
			}
		}
		return true
	}, what)
}

// needFDs makes RLIMIT_NOFILE allow n descriptors for the test's duration,
// raising the hard limit too where it is lower (which needs privilege).
func needFDs(t *testing.T, n uint64) {
	t.Helper()
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Cur >= n {
		return
	}
	old := lim
	lim.Cur, lim.Max = n, max(lim.Max, n)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatalf("the test needs %d file descriptors, RLIMIT_NOFILE is %d (hard %d): %v", n, old.Cur, old.Max, err)
	}
	t.Logf("raised RLIMIT_NOFILE from %d to %d", old.Cur, n)
	t.Cleanup(func() { syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old) })
}

// liveHeap is the heap in use after two garbage collections (the second
// frees what the first moved out of sync.Pools).
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// A preamble accepted before a configuration reload is still known after
// it: every configuration has a new verifier, but they share the replay
// cache, so a replay within the frame's TTL is refused.
func TestSandboxReplayCacheSurvivesReload(t *testing.T) {
	up := forwardtest.NewUpstream(t, 0)
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	frame := e.gw.Frame(t, "sbx-replay", up.Addr())
	e.emptyTunnel(t, frame)
	waitIdle(t)
	if up.Accepted() != 1 {
		t.Fatalf("upstream accepted %d connections for the first use, want 1", up.Accepted())
	}

	e.sandboxHandler()["preamble_timeout"] = "4s" // a changed configuration
	e.load(t)
	if refs, ok := forwarder.ReplayCacheReferences(preamble.DefaultReplayCacheSize, preamble.ReplayWindow(0, 0)); !ok || refs != 1 {
		t.Errorf("after the reload the replay cache has %d references (present: %v), want 1: the old configuration's was not released", refs, ok)
	}

	before := forwarder.Tunnels().RefusedTunnels()[string(preamble.ReasonReplayedNonce)]
	c := e.rawTunnel(t, frame, false)
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, _ := io.Copy(io.Discard, c); n != 0 {
		t.Errorf("replayed frame: the client read %d bytes, want none", n)
	}
	waitRejections(t, string(preamble.ReasonReplayedNonce), before+1)
	if up.Accepted() != 1 {
		t.Errorf("upstream accepted %d connections, want 1: the replay was dialed", up.Accepted())
	}
}

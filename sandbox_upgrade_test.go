package caddyktls

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
	"golang.org/x/sys/unix"
)

// A binary upgrade with the real binary: a second process started with
// the same configuration takes the listening socket and the tunnels of the
// running one, which then exits. Tunnels streaming both ways arrive exact,
// clients connecting in a loop throughout are never refused or reset, and
// a preamble accepted before is refused after as a replay.

// TestKernelUpgradeMovesTunnels: every tunnel (kernel TLS) moves to the new
// process mid-stream; the old process exits at once, no tunnel left to
// drain. Where the kernel rekeys, the moved tunnels renew their keys both
// ways in the new process.
func TestKernelUpgradeMovesTunnels(t *testing.T) {
	kerneltest.Require(t)
	sandboxUpgrade(t, true)
}

// TestUpgradeUserspaceTunnelsStay: tunnels whose gateway session runs in
// userspace TLS (a kernel without kTLS) cannot move; they finish in the old
// process, which drains them, while the new process takes every new
// connection.
func TestUpgradeUserspaceTunnelsStay(t *testing.T) {
	if kerneltest.Required() {
		t.Skip("the kernel variant is TestKernelUpgradeMovesTunnels")
	}
	sandboxUpgrade(t, false)
}

// KTLS_LOAD_TUNNELS sizes the streaming tunnels (default 8); past 8 each
// is paced slower, so that the VM's one emulated CPU keeps up.
func sandboxUpgrade(t *testing.T, kernel bool) {
	const chunk = 4 << 10
	n := kerneltest.PositiveEnv(t, "KTLS_LOAD_TUNNELS", 8)
	pace := max(20*time.Millisecond, time.Duration(n)*2500*time.Microsecond)
	// Liveness bounds: with hundreds of tunnels on the VM's one emulated
	// CPU every step takes minutes, more on a loaded machine.
	stepBound, handoffBound := time.Minute, 2*time.Minute
	if n > 8 {
		stepBound, handoffBound = 10*time.Minute, 15*time.Minute
	}
	up := forwardtest.NewPacedUpstream(t, chunk, pace)
	small := forwardtest.NewUpstream(t, 4<<10)
	// The standby connections wait, and the replayed preamble stays valid,
	// from before the streams start until after the upgrade: with hundreds
	// of tunnels, minutes in the VM.
	e := newSandboxConfig(t, map[string]any{"drain_grace_period": "2m", "standby_timeout": "10m", "max_preamble_ttl": "30m"})
	if n > 8 {
		// A liveness bound no tighter than the looping calls' own
		// (callTimeout): with hundreds of tunnels streaming on the VM's
		// one emulated CPU, a looping call's handshake outlasted the
		// harness's 2 minutes on a loaded host, in the test process as
		// much as in the forwarder.
		e.route()["handle"].([]any)[0].(map[string]any)["handshake_timeout"] = "3m"
	}
	handoffConfig(e, filepath.Join(t.TempDir(), "handoff.sock"))
	// Where the kernel rekeys (TLS 1.3, Linux 6.14+), each key of the
	// forwarder's protects 64 records: in the new process, the moved
	// tunnels renew their own keys (KeyUpdate sent, TX rekeyed) and ask
	// the gateway to renew its own (its KeyUpdate applied, RX rekeyed),
	// on the kernel state, secrets and limits that moved. The gateways'
	// sessions are kernel TLS then: a Go crypto/tls gateway that
	// half-closes with a request on its way fails the records behind it
	// (README, Limits). (At the default size only: a limit that low renews
	// a key at nearly every splice, which hundreds of tunnels cannot
	// afford on the VM's one emulated CPU.)
	rekey := kernel && ktls.Probe().Rekey && n <= 8
	gatewayKTLS := ktls.Options{Disable: true}
	if rekey {
		e.route()["handle"].([]any)[0].(map[string]any)["key_record_limit"] = 64
		// A key per splice is far above a gateway's default KeyUpdate
		// rate limit.
		gatewayKTLS = ktls.Options{RequireOffload: true, KeyUpdateLimit: ktls.Rate{PerSecond: 1e6, Burst: 1e6}}
	}
	old := startCaddy(t, e, "")
	since := dataPathDelta(t, kernel)

	stop := make(chan struct{})
	// Every tunnel opens before any streams: the handshakes do not compete
	// with hundreds of streams for the VM's one emulated CPU.
	var conns []*ktls.Conn
	for i := range n {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
		c, err := gatewayDialWith(ctx, e.addr, e.tlsConfig(e.client), e.gw.Signer, fmt.Sprintf("sbx-upgrade-%d", i), up.Addr(), gatewayKTLS)
		cancel()
		if err != nil {
			t.Fatalf("tunnel %d: %v", i, err)
		}
		conns = append(conns, c)
	}
	// Gateways' standby connections: mutual TLS done, no preamble yet.
	// In kernel TLS they move, and their preamble, written once the old
	// process is gone, opens a tunnel in the new one. (Opened before the
	// streams start: with hundreds streaming, a scrape of /metrics in the
	// VM outlasts the admin endpoint's timeouts.)
	const standbys = 3
	var waiting []*tls.Conn
	for range standbys {
		d := tls.Dialer{Config: e.tlsConfig(e.client)}
		c, err := d.DialContext(t.Context(), "tcp", e.addr)
		if err != nil {
			t.Fatalf("a standby connection: %v", err)
		}
		t.Cleanup(func() { c.Close() })
		waiting = append(waiting, c.(*tls.Conn))
	}
	waitUntil(t, stepBound, func() bool { return e.metric(t, "caddy_ktls_sandbox_standby_connections") == standbys },
		"the standby connections waiting in the forwarder")

	var streams []<-chan streamOutcome
	progress := make([]streamProgress, n)
	for i, c := range conns {
		streams = append(streams, pacedStreamWatched(c, uint64(500+i), chunk, pace, stop, &progress[i]))
	}
	waitUntil(t, stepBound, func() bool { return up.Accepted() == n && up.Received() >= int64(n*chunk) },
		"every tunnel's first bytes at the upstream")

	// A preamble accepted before the upgrade is refused after it, as a
	// replay: the replay cache moved.
	now := time.Now()
	frame := e.gw.Sign(t, preamble.Claims{SandboxID: "sbx-upgrade-replayed", Target: small.Addr(), IssuedAt: now, ExpiresAt: now.Add(20 * time.Minute)})
	if got, err := io.ReadAll(e.rawTunnel(t, frame, true)); err != nil || len(got) != 4<<10 {
		t.Fatalf("a tunnel before the upgrade read %d bytes, %v; want the target's 4 KiB", len(got), err)
	}

	// Clients connecting in a loop through the upgrade. Their own deadline
	// is a liveness bound: with hundreds of tunnels streaming, a handshake
	// on the VM's one emulated CPU takes over 30 s.
	callTimeout := 30 * time.Second
	if n > 8 {
		callTimeout = 3 * time.Minute
	}
	var calls, failed atomic.Int64
	var firstErr atomic.Value
	loopDone := make(chan struct{})
	var loop sync.WaitGroup
	for c := range 4 {
		loop.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-loopDone:
					return
				default:
				}
				calls.Add(1)
				if err := oneCallWithin(e, fmt.Sprintf("sbx-upgrade-loop-%d-%d", c, i), small.Addr(), callTimeout); err != nil {
					failed.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				}
			}
		})
	}

	_, took, handed := upgradeProcess(t, e, handoffBound)
	// Every streaming tunnel moves in kernel TLS (and so may a looping
	// call open at the time); none in userspace TLS.
	moved, _ := handed["moved"].(float64)
	if took["tunnels"] != moved || (kernel && moved < float64(n)) || (!kernel && moved != 0) {
		t.Errorf("the new process took %v tunnels, the old one handed %v over; want the same, at least %d in kernel TLS, none in userspace TLS", took["tunnels"], handed["moved"], n)
	}
	// A looping call between its handshake and its preamble is a standby
	// connection too, for the forwarder.
	if got, _ := handed["standby_moved"].(float64); took["standby"] != got || (kernel && got < standbys) || (!kernel && got != 0) {
		t.Errorf("the new process took %v standby connections, the old one handed %v over; want the same, at least %d in kernel TLS, none in userspace TLS", took["standby"], handed["standby_moved"], standbys)
	}
	if !kernel {
		// The streams end, so that the old process's drain ends, and the
		// standby connections close.
		close(stop)
		for _, c := range waiting {
			c.Close()
		}
	}
	select {
	case <-old.exited:
		if old.exitErr != nil {
			t.Errorf("the old process exited with %v", old.exitErr)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the old process did not exit after the handoff")
	}
	if kernel {
		// The moved tunnels stream on in the new process.
		at := up.Received()
		afterHandoff, gw0 := dataPathDelta(t, kernel), ktls.Stats()
		waitUntil(t, stepBound, func() bool { return up.Received() >= at+int64(n*chunk) }, "bytes through the moved tunnels")
		if rekey {
			// Only the new process and the gateways (this process, whose
			// ktls.Stats count its own) run kernel TLS now: the rest of
			// tls_stat's renewals are the new process's.
			want := int64(n)
			for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
				stat, _ := afterHandoff()
				gw := ktls.Stats()
				tx := stat["TlsTxRekeyOk"] - int64(gw.KeyUpdatesSent-gw0.KeyUpdatesSent)
				rx := stat["TlsRxRekeyOk"] - int64(gw.KeyUpdates-gw0.KeyUpdates)
				if tx >= want && rx >= want {
					t.Logf("in the new process: TX keys renewed %d, RX keys renewed %d (tls_stat %+d/%+d less the gateways' %d/%d)",
						tx, rx, stat["TlsTxRekeyOk"], stat["TlsRxRekeyOk"], gw.KeyUpdatesSent-gw0.KeyUpdatesSent, gw.KeyUpdates-gw0.KeyUpdates)
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("in 3m after the handoff, the new process renewed %d TX and %d RX keys; want %d each: a key renewed each way per moved tunnel", tx, rx, want)
				}
			}
		}
		close(stop)
	}
	close(loopDone)
	loop.Wait()
	if kernel {
		// The old process has exited: each standby connection's preamble
		// opens its tunnel in the new one.
		for i, c := range waiting {
			if err := preamble.Send(t.Context(), c, e.gw.Signer, preamble.Claims{SandboxID: fmt.Sprintf("sbx-standby-%d", i), Target: small.Addr()}); err != nil {
				t.Fatalf("standby connection %d: the preamble: %v", i, err)
			}
			c.SetDeadline(time.Now().Add(time.Minute))
			n, sum, err := transfer(c, 1<<10, 7)
			if err != nil || n != 4<<10 || sum != forwardtest.PatternSum(2, 4<<10) {
				t.Errorf("standby connection %d after the upgrade: read %d bytes (want %d), the same hash %v, %v", i, n, 4<<10, sum == forwardtest.PatternSum(2, 4<<10), err)
			}
		}
	}
	replayed, _ := io.ReadAll(e.rawTunnel(t, frame, true))
	if len(replayed) != 0 {
		t.Errorf("a preamble replayed after the upgrade read %d bytes; want none (refused)", len(replayed))
	}
	var activity struct {
		Rejections map[string]uint64 `json:"rejections"`
	}
	waitUntil(t, 30*time.Second, func() bool {
		e.adminGet(t, "/sandbox/activity", &activity)
		return activity.Rejections["replayed-nonce"] > 0
	}, "the replayed preamble's refusal (replayed-nonce) in GET /sandbox/activity")
	if len(activity.Rejections) != 1 || activity.Rejections["replayed-nonce"] != 1 {
		t.Errorf("rejections %v, want one replayed-nonce", activity.Rejections)
	}
	// Each stream half-closed when stop closed and ends once its tunnel
	// carried the end both ways: a tunnel that never does fails the test
	// with what the forwarder says of it, its log among the output.
	outcomes := make([]streamOutcome, len(streams))
	bound := time.After(stepBound)
	for i, s := range streams {
		select {
		case outcomes[i] = <-s:
		case <-bound:
			var open []int
			for j := i; j < len(streams); j++ {
				select {
				case outcomes[j] = <-streams[j]:
				default:
					open = append(open, j)
				}
			}
			var ends []netip.AddrPort
			for _, j := range open {
				t.Logf("tunnel %d (gateway end %v): %v", j, conns[j].LocalAddr(), &progress[j])
				ends = append(ends, conns[j].LocalAddr().(*net.TCPAddr).AddrPort())
			}
			logStalled(t, e, ends)
			var listed []forward.TunnelInfo
			e.adminGet(t, "/sandbox/tunnels", &listed)
			t.Fatalf("%v after the streams half-closed, tunnels %v (sbx-upgrade-<i>) have not ended; the forwarder's open tunnels: %+v", stepBound, open, listed)
		}
	}
	up.Close()
	for i, o := range outcomes {
		if o.err != nil || !exactAtUpstream(o, up.Results()) || o.recv == 0 {
			t.Errorf("tunnel %d (sent %d, received %d, %v): not carried exact both ways through the upgrade", i, o.sent, o.recv, o.err)
		}
	}
	if f := failed.Load(); f != 0 || calls.Load() == 0 {
		t.Errorf("%d of %d calls through the upgrade failed (first: %v); want none", f, calls.Load(), firstErr.Load())
	}
	if kernel {
		stat, _ := since()
		if stat["TlsDecryptError"] != 0 {
			t.Errorf("tls_stat TlsDecryptError %+d through the upgrade", stat["TlsDecryptError"])
		}
	}
	t.Logf("%d calls through the upgrade; old process: %v; new process: %v", calls.Load(), handed, took)
}

// exactAtUpstream reports whether one of the upstream's connections
// received exactly what o sent and sent exactly what o received.
func exactAtUpstream(o streamOutcome, ups []forwardtest.Result) bool {
	for _, r := range ups {
		if r.RecvSum == o.sentSum && r.Received == o.sent && r.SentSum == o.recvSum && r.Sent == o.recv {
			return true
		}
	}
	return false
}

// oneCall opens a tunnel to target (a forwardtest.NewUpstream of 4 KiB),
// sends 1 KiB, closes its side and reads the reply to the end: the
// upstream's 4 KiB exactly.
func oneCall(e *sandboxEnv, sandbox string, target netip.AddrPort) error {
	return oneCallWithin(e, sandbox, target, 30*time.Second)
}

// oneCallWithin is oneCall, the client's own deadline for its handshake and
// for its transfer each timeout.
func oneCallWithin(e *sandboxEnv, sandbox string, target netip.AddrPort, timeout time.Duration) error {
	c, err := e.openTunnel(sandbox, target, timeout)
	if err != nil {
		return err
	}
	c.SetDeadline(time.Now().Add(timeout))
	n, sum, err := transfer(c, 1<<10, 7)
	if err == nil && (n != 4<<10 || sum != forwardtest.PatternSum(2, 4<<10)) {
		err = fmt.Errorf("reply of %d bytes (want %d) or another hash", n, 4<<10)
	}
	return err
}

// TestUpgradeServesConnectionsAcceptedBefore: the connections the old
// process accepted before the switch are served there to their end,
// whatever step they were in when the handoff ended: one still in its TLS
// handshake (it outlasts the settle step), and one whose handshake is done
// and whose preamble comes after the handoff (a standby connection in
// userspace TLS, which cannot move). Each opens its tunnel in the old
// process, carried exact both ways, where the drain used to refuse it
// (draining) or the exit cut it; the old process exits once they ended.
func TestUpgradeServesConnectionsAcceptedBefore(t *testing.T) {
	if kerneltest.Required() {
		t.Skip("the same on every kernel: a host test")
	}
	small := forwardtest.NewUpstream(t, 4<<10)
	// The handshake held and the standby connection outlast the old
	// process's settle step (10 s) and the waits before the handoff (up
	// to 1 minute for each to be held, 2 for the new process to start),
	// and the grace period the calls after it: on a busy host the new
	// process's start alone took over a minute.
	e := newSandboxConfig(t, map[string]any{"drain_grace_period": "5m", "standby_timeout": "5m"})
	e.route()["handle"].([]any)[0].(map[string]any)["handshake_timeout"] = "5m"
	handoffConfig(e, filepath.Join(t.TempDir(), "handoff.sock"))
	old := startCaddy(t, e, "")

	// No byte: the old process's handshake waits for the ClientHello.
	hold, err := net.Dial("tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hold.Close() })
	waitUntil(t, time.Minute, func() bool { return e.metric(t, "caddy_ktls_handshakes_in_progress") == 1 }, "the held connection in its handshake")
	d := tls.Dialer{Config: e.tlsConfig(e.client)}
	standby, err := d.DialContext(t.Context(), "tcp", e.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { standby.Close() })
	waitUntil(t, time.Minute, func() bool { return e.metric(t, "caddy_ktls_sandbox_standby_connections") == 1 }, "the standby connection")

	_, took, handed := upgradeProcess(t, e, 2*time.Minute)
	if took["tunnels"] != 0.0 || took["standby"] != 0.0 {
		t.Errorf("the new process took %v tunnels and %v standby connections; want none (userspace TLS, a handshake)", took["tunnels"], took["standby"])
	}

	call := func(name string, c *tls.Conn) {
		t.Helper()
		c.SetDeadline(time.Now().Add(time.Minute))
		if err := c.Handshake(); err != nil {
			t.Fatalf("%s: the handshake with the old process after the handoff: %v", name, err)
		}
		if err := preamble.Send(t.Context(), c, e.gw.Signer, preamble.Claims{SandboxID: "sbx-" + name, Target: small.Addr()}); err != nil {
			t.Fatalf("%s: the preamble: %v", name, err)
		}
		n, sum, err := transfer(c, 1<<10, 7)
		if err != nil || n != 4<<10 || sum != forwardtest.PatternSum(2, 4<<10) {
			t.Errorf("%s after the handoff: read %d bytes (want %d), the same hash %v, %v", name, n, 4<<10, sum == forwardtest.PatternSum(2, 4<<10), err)
		}
	}
	call("held-handshake", tls.Client(hold, e.tlsConfig(e.client)))
	call("standby", standby.(*tls.Conn))

	serving := e.waitLogLine(t, "serving the connections accepted before the handoff to their end: their tunnels open here; this process exits once it holds none, or when the grace period ends", 0)
	if serving["connections"] != 2.0 {
		t.Errorf("the old process serves %v connections accepted before the handoff; want 2", serving["connections"])
	}

	select {
	case <-old.exited:
		if old.exitErr != nil {
			t.Errorf("the old process exited with %v", old.exitErr)
		}
	case <-time.After(time.Minute):
		t.Fatal("the old process did not exit once the connections it accepted before the handoff ended")
	}
	e.waitLogLine(t, "served every connection accepted before the handoff", 0)
	if lines := e.logLines(t, rejectedMsg); len(lines) != 0 {
		t.Errorf("the old process refused %d tunnels: %v", len(lines), lines)
	}
	t.Logf("old process: %v; new process: %v", handed, took)
}

// A process started with another handoff socket cannot reach the running
// one: it does not start, as the tcp-handoff port is the running one's
// (bound without SO_REUSEPORT), and the running one serves on, its tunnel
// untouched.
func TestUpgradeSocketUnreachable(t *testing.T) {
	if kerneltest.Required() {
		t.Skip("the same on every kernel: a host test")
	}
	up := forwardtest.NewPacedUpstream(t, 4<<10, 20*time.Millisecond)
	small := forwardtest.NewUpstream(t, 4<<10)
	e := newSandboxConfig(t, nil)
	handoffConfig(e, filepath.Join(t.TempDir(), "handoff.sock"))
	startCaddy(t, e, "")
	stop := make(chan struct{})
	stream := pacedStream(e.dial(t, "sbx-unreachable", up.Addr()), 600, 4<<10, 20*time.Millisecond, stop)

	nu := secondProcessConfig(t, e)
	nu.cfg["apps"].(map[string]any)["sandbox_handoff"].(map[string]any)["socket"] = filepath.Join(t.TempDir(), "elsewhere.sock")
	p := startCaddy(t, nu, "")
	select {
	case <-p.exited:
		if p.exitErr == nil {
			t.Error("the second process exited 0; want a failed start (the port is taken)")
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the second process kept running beside the first on one port")
	}
	if err := oneCall(e, "sbx-unreachable-call", small.Addr()); err != nil {
		t.Errorf("a call after the failed start: %v", err)
	}
	close(stop)
	o := <-stream
	up.Close()
	if o.err != nil || !exactAtUpstream(o, up.Results()) || o.recv == 0 {
		t.Errorf("the running process's tunnel (sent %d, received %d, %v): not exact both ways", o.sent, o.recv, o.err)
	}
}

// handoffConfig makes e's layer4 server listen on tcp-handoff/ and adds the
// sandbox_handoff app at socket.
func handoffConfig(e *sandboxEnv, socket string) {
	server := e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)["tunnels"].(map[string]any)
	server["listen"] = []string{"tcp-handoff/" + e.addr}
	e.cfg["apps"].(map[string]any)["sandbox_handoff"] = map[string]any{"socket": socket, "timeout": "1m"}
}

// secondProcessConfig is e's configuration for a second process: the same,
// but for the log file.
func secondProcessConfig(t *testing.T, e *sandboxEnv) *sandboxEnv {
	t.Helper()
	nu := *e
	nu.logFile = filepath.Join(t.TempDir(), "caddy-new.log")
	nu.cfg = cloneJSON(t, e.cfg)
	logs := nu.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)
	logs["writer"].(map[string]any)["filename"] = nu.logFile
	return &nu
}

// upgradeProcess starts a second process of e's configuration
// (secondProcessConfig), which takes over from the one running, and waits
// up to bound for the handoff's log lines: the new process's (took) and
// the old one's (handed).
func upgradeProcess(t *testing.T, e *sandboxEnv, bound time.Duration) (nu *sandboxEnv, took, handed map[string]any) {
	t.Helper()
	nu = secondProcessConfig(t, e)
	startCaddy(t, nu, "") // returns at once: the old process listens
	waitUntil(t, 2*time.Minute, func() bool { _, err := os.Stat(nu.logFile); return err == nil }, "the new process's log")
	const tookMsg, handedMsg = "took the running process's tunnels over", "handed the tunnels over to the new process"
	waitUntil(t, bound, func() bool { return len(nu.logLines(t, tookMsg)) > 0 && len(e.logLines(t, handedMsg)) > 0 }, "the handoff's log lines")
	return nu, nu.waitLogLine(t, tookMsg, 0), e.waitLogLine(t, handedMsg, 0)
}

// Either process of an upgrade is killed during the handoff: the other
// serves on, and its log says what happened. A connection that stays in
// its TLS handshake holds the old process in its settle step (it waits
// for the connections it accepted), after it stopped accepting and before
// its state moves: there the test kills one of the two.

// midHandoff is an upgrade held in the old process's settle step.
type midHandoff struct {
	e, nuEnv *sandboxEnv
	old, nu  *caddyProcess
	stream   <-chan streamOutcome // a tunnel of the old process, streaming both ways
	stop     chan struct{}
	up       *forwardtest.Upstream
	hold     net.Conn // in its TLS handshake with the old process
}

// killMidHandoff starts an upgrade and returns once the old process has
// stopped accepting and waits for hold's handshake.
func killMidHandoff(t *testing.T) *midHandoff {
	if kerneltest.Required() {
		t.Skip("the same on every kernel: a host test")
	}
	m := &midHandoff{stop: make(chan struct{})}
	m.up = forwardtest.NewPacedUpstream(t, 4<<10, 20*time.Millisecond)
	m.e = newSandboxConfig(t, map[string]any{"drain_grace_period": "1m"})
	handoffConfig(m.e, filepath.Join(t.TempDir(), "handoff.sock"))
	m.old = startCaddy(t, m.e, "")
	m.stream = pacedStream(m.e.dial(t, "sbx-mid-handoff", m.up.Addr()), 700, 4<<10, 20*time.Millisecond, m.stop)
	hold, err := net.Dial("tcp", m.e.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hold.Close() })
	// A TLS record header and no record: the handshake waits for it.
	if _, err := hold.Write([]byte{0x16, 0x03, 0x01, 0x02, 0x00}); err != nil {
		t.Fatal(err)
	}
	m.hold = hold
	m.nuEnv = secondProcessConfig(t, m.e)
	m.nu = startCaddy(t, m.nuEnv, "")
	m.e.waitLogLine(t, "the new process asks for the tunnels: this process stops accepting, then hands its state and tunnels over", 0)
	// The settle step waits for hold, its state not moved.
	time.Sleep(200 * time.Millisecond)
	if lines := m.e.logLines(t, "handed the tunnels over to the new process"); len(lines) != 0 {
		t.Fatal("the old process handed over without waiting for the handshake in progress: the test proves nothing")
	}
	return m
}

// TestUpgradeNewProcessKilled: the old process takes everything back: it
// accepts again, and its tunnel streams on exact.
func TestUpgradeNewProcessKilled(t *testing.T) {
	m := killMidHandoff(t)
	m.nu.cmd.Process.Kill()
	<-m.nu.exited
	m.hold.Close() // the settle step ends
	m.e.waitLogLine(t, "the new process did not take the process state over: this process goes on serving every tunnel it holds and accepting", 0)
	small := forwardtest.NewUpstream(t, 4<<10)
	if err := oneCall(m.e, "sbx-killed-new", small.Addr()); err != nil {
		t.Errorf("a call after the new process was killed: %v", err)
	}
	close(m.stop)
	o := <-m.stream
	m.up.Close()
	if o.err != nil || !exactAtUpstream(o, m.up.Results()) || o.recv == 0 {
		t.Errorf("the old process's tunnel (sent %d, received %d, %v): not exact both ways", o.sent, o.recv, o.err)
	}
	select {
	case <-m.old.exited:
		t.Errorf("the old process exited (%v)", m.old.exitErr)
	default:
	}
}

// TestUpgradeOldProcessKilled: the new process serves as after a restart;
// the old process's tunnel ended with it.
func TestUpgradeOldProcessKilled(t *testing.T) {
	m := killMidHandoff(t)
	m.old.cmd.Process.Kill()
	<-m.old.exited
	m.nuEnv.waitLogLine(t, "the running process (pid "+fmt.Sprint(m.old.cmd.Process.Pid)+") died before it handed its state over: this process serves as after a restart (a report stream of its own, empty replay caches); the tunnels of the process that died ended with it", 0)
	small := forwardtest.NewUpstream(t, 4<<10)
	if err := oneCall(m.e, "sbx-killed-old", small.Addr()); err != nil {
		t.Errorf("a call after the old process was killed: %v", err)
	}
	if o := <-m.stream; o.err == nil {
		t.Errorf("the killed process's tunnel ended without an error (sent %d, received %d)", o.sent, o.recv)
	}
	close(m.stop)
	m.up.Close()
	select {
	case <-m.nu.exited:
		t.Errorf("the new process exited (%v)", m.nu.exitErr)
	default:
	}
}

// caddy validate of the running process's configuration provisions it
// and starts nothing: it takes no listening socket over, and the running
// process hands nothing out.
func TestUpgradeValidateTakesNothing(t *testing.T) {
	if kerneltest.Required() {
		t.Skip("the same on every kernel: a host test")
	}
	e := newSandboxConfig(t, nil)
	handoffConfig(e, filepath.Join(t.TempDir(), "handoff.sock"))
	startCaddy(t, e, "")
	out, err := exec.Command(builtCaddy(t), "validate", "--config", e.configFile(t)).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Valid configuration") {
		t.Fatalf("caddy validate: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "took the listening sockets") {
		t.Errorf("caddy validate took the running process's listening sockets:\n%s", out)
	}
	small := forwardtest.NewUpstream(t, 4<<10)
	if err := oneCall(e, "sbx-after-validate", small.Addr()); err != nil { // the log is written by now
		t.Errorf("a call after caddy validate: %v", err)
	}
	if lines := e.logLines(t, "a new process shares the listening sockets; this process goes on accepting until it takes the tunnels over"); len(lines) != 0 {
		t.Errorf("the running process handed its listening sockets to caddy validate: %v", lines)
	}
}

// TestKernelUpgradeStandbyToItsHandler: two sandbox handlers, on two
// listeners, each trusting only its own gateway's key. A gateway's standby
// connection waiting in each moves to the new process's handler configured
// as the one it waited in: a preamble signed with that handler's key opens
// its tunnel there (the other handler would refuse it).
func TestKernelUpgradeStandbyToItsHandler(t *testing.T) {
	kerneltest.Require(t)
	small := forwardtest.NewUpstream(t, 4<<10)
	e := newSandboxConfig(t, map[string]any{"standby_timeout": "10m"})
	handoffConfig(e, filepath.Join(t.TempDir(), "handoff.sock"))
	gw2 := forwardtest.NewGateway(t, "gw-2")
	addr2 := loopbackAddr(t)
	servers := e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)
	second := cloneJSON(t, servers["tunnels"].(map[string]any))
	second["listen"] = []string{"tcp-handoff/" + addr2}
	second["routes"].([]any)[0].(map[string]any)["handle"].([]any)[1].(map[string]any)["keys"] = []any{
		map[string]any{"id": "gw-2", "public_key": base64.StdEncoding.EncodeToString(gw2.Pub)}}
	servers["tunnels-2"] = second
	old := startCaddy(t, e, "")

	type waiting struct {
		c       *tls.Conn
		signer  *preamble.Signer
		sandbox string
	}
	var standby []waiting
	for i, w := range []struct {
		addr   string
		signer *preamble.Signer
	}{{e.addr, e.gw.Signer}, {addr2, gw2.Signer}} {
		d := tls.Dialer{Config: e.tlsConfig(e.client)}
		c, err := d.DialContext(t.Context(), "tcp", w.addr)
		if err != nil {
			t.Fatalf("a standby connection to %s: %v", w.addr, err)
		}
		t.Cleanup(func() { c.Close() })
		standby = append(standby, waiting{c.(*tls.Conn), w.signer, fmt.Sprintf("sbx-standby-handler-%d", i+1)})
	}
	waitUntil(t, time.Minute, func() bool { return e.metric(t, "caddy_ktls_sandbox_standby_connections") == 2 },
		"the standby connections waiting in the forwarder")

	_, took, handed := upgradeProcess(t, e, 2*time.Minute)
	if took["standby"] != 2.0 || handed["standby_moved"] != 2.0 {
		t.Fatalf("the new process took %v standby connections, the old one handed %v over (stayed: %v); want both", took["standby"], handed["standby_moved"], handed["standby_stayed"])
	}
	select {
	case <-old.exited:
	case <-time.After(2 * time.Minute):
		t.Fatal("the old process did not exit after the handoff")
	}
	for _, w := range standby {
		if err := preamble.Send(t.Context(), w.c, w.signer, preamble.Claims{SandboxID: w.sandbox, Target: small.Addr()}); err != nil {
			t.Fatalf("%s: the preamble: %v", w.sandbox, err)
		}
		w.c.SetDeadline(time.Now().Add(time.Minute))
		n, sum, err := transfer(w.c, 1<<10, 7)
		if err != nil || n != 4<<10 || sum != forwardtest.PatternSum(2, 4<<10) {
			t.Errorf("%s after the upgrade: read %d bytes (want %d), the same hash %v, %v: want its tunnel opened by the handler that trusts its key", w.sandbox, n, 4<<10, sum == forwardtest.PatternSum(2, 4<<10), err)
		}
	}
}

// logStalled logs what says where tunnels that do not end wait: the TCP
// sockets holding unread or unacknowledged bytes (/proc/net/tcp), the
// kernel's view of the forwarder's socket of each gateway end in ends
// (kernelSocket), and the goroutines of this process's streams and of the
// Caddy at e that relay.
func logStalled(t *testing.T, e *sandboxEnv, ends []netip.AddrPort) {
	t.Helper()
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Logf("/proc/net/tcp: %v", err)
	}
	for _, end := range ends {
		t.Logf("the forwarder's socket of gateway end %v: %s", end, kernelSocket(t, data, end))
	}
	t.Logf("sockets with bytes queued (local remote state tx_queue:rx_queue, hex):%s", forwardtest.QueuedSockets(t, data))
	var own bytes.Buffer
	pprof.Lookup("goroutine").WriteTo(&own, 1)
	t.Logf("this process's stream goroutines:\n%s", forwardtest.GoroutineBlocks(own.String(), "pacedStream"))
	t.Logf("the Caddy's relay goroutines:\n%s", forwardtest.GoroutineBlocks(string(e.adminBody(t, "/debug/pprof/goroutine?debug=1")), "splice.", "forward."))
}

// kernelSocket describes, as the kernel has it, the socket whose peer is
// remote: its line of /proc/net/tcp (data), and for each process holding it the
// descriptor's flags, whether an epoll instance of that process watches
// it, and, on a copy taken with pidfd_getfd, what poll(2) reports, the
// bytes TCP holds unread (SIOCINQ) and the kernel TLS record sequence
// numbers (the next record each direction opens or seals).
func kernelSocket(t *testing.T, data []byte, remote netip.AddrPort) string {
	var b strings.Builder
	inode := ""
	for _, f := range forwardtest.ProcNetTCPLines(data) {
		if forwardtest.ProcNetAddr(t, f[2]) == remote.String() {
			fmt.Fprintf(&b, "%s %s st %s tx:rx %s timer %s retr %s inode %s", forwardtest.ProcNetAddr(t, f[1]), remote, f[3], f[4], f[5], f[6], f[9])
			inode = f[9]
		}
	}
	if inode == "" {
		return "not in /proc/net/tcp"
	}
	pids, _ := filepath.Glob("/proc/[0-9]*")
	for _, dir := range pids {
		fds, _ := filepath.Glob(dir + "/fd/*")
		for _, fdPath := range fds {
			if link, _ := os.Readlink(fdPath); link != "socket:["+inode+"]" {
				continue
			}
			pid, _ := strconv.Atoi(filepath.Base(dir))
			fd, _ := strconv.Atoi(filepath.Base(fdPath))
			info, _ := os.ReadFile(fmt.Sprintf("%s/fdinfo/%d", dir, fd))
			flags := ""
			for _, l := range strings.Split(string(info), "\n") {
				if strings.HasPrefix(l, "flags:") {
					flags = strings.TrimSpace(strings.TrimPrefix(l, "flags:"))
				}
			}
			fmt.Fprintf(&b, "\n  pid %d fd %d flags %s, watched by epoll: %v; %s", pid, fd, flags, epollWatches(dir, fd), probeSocket(pid, fd))
		}
	}
	return b.String()
}

// epollWatches returns the epoll instances of the process at dir whose
// interest list has fd, with the events asked for.
func epollWatches(dir string, fd int) []string {
	var out []string
	fds, _ := filepath.Glob(dir + "/fd/*")
	for _, fdPath := range fds {
		if link, _ := os.Readlink(fdPath); link != "anon_inode:[eventpoll]" {
			continue
		}
		info, _ := os.ReadFile(dir + "/fdinfo/" + filepath.Base(fdPath))
		for _, l := range strings.Split(string(info), "\n") {
			if f := strings.Fields(l); len(f) >= 4 && f[0] == "tfd:" && f[1] == strconv.Itoa(fd) {
				out = append(out, fmt.Sprintf("epfd %s events %s", filepath.Base(fdPath), f[3]))
			}
		}
	}
	return out
}

// probeSocket takes a copy of descriptor fd of process pid and reports
// what the kernel says of its socket, consuming nothing.
func probeSocket(pid, fd int) string {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return fmt.Sprintf("pidfd_open: %v", err)
	}
	defer unix.Close(pidfd)
	s, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return fmt.Sprintf("pidfd_getfd: %v", err)
	}
	defer unix.Close(s)
	pfd := []unix.PollFd{{Fd: int32(s), Events: unix.POLLIN | unix.POLLRDHUP | unix.POLLOUT}}
	n, err := unix.Poll(pfd, 0)
	out := fmt.Sprintf("poll %d revents %#x (%v)", n, pfd[0].Revents, err)
	inq, err := unix.IoctlGetInt(s, unix.SIOCINQ)
	out += fmt.Sprintf(", SIOCINQ %d (%v)", inq, err)
	for _, dir := range []struct {
		name string
		opt  uintptr
	}{{"TX", 1}, {"RX", 2}} {
		// The crypto_info of each cipher ends with its 8-byte record
		// sequence number; the kernel wants its exact size: 40 bytes
		// (AES-128-GCM), 56 (AES-256-GCM, ChaCha20-Poly1305).
		var buf [56]byte
		var l uint32
		var errno syscall.Errno
		for _, size := range []uint32{40, 56} {
			l = size
			if _, _, errno = unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(s), unix.SOL_TLS, dir.opt, uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&l)), 0); errno != unix.EINVAL {
				break
			}
		}
		if errno != 0 || l < 12 {
			out += fmt.Sprintf(", TLS_%s: %v", dir.name, errno)
			continue
		}
		out += fmt.Sprintf(", TLS_%s cipher %#x rec_seq %d", dir.name, binary.LittleEndian.Uint16(buf[2:4]), binary.BigEndian.Uint64(buf[l-8:l]))
		clear(buf[:])
	}
	return out
}

// TestUpgradeEncodings: the build's handoff hello names the encoding of
// every state it moves, with the versions the packages encode in: the
// process state's, the session's and relay's that every moved object
// carries, and each participant's objects', the edge gateway's tunnels
// among them. Two builds that differ in any one refuse each other.
func TestUpgradeEncodings(t *testing.T) {
	got := upgrade.Encodings()
	want := fmt.Sprintf("report %d, process 1, ktls %d, pause %d, standby %d, tunnel %d, gateway tunnel %d",
		forward.ReportStateVersion, ktls.HandoffVersion, splice.PauseVersion, forward.MovedStandbyVersion, forward.MovedTunnelVersion, gateway.MovedTunnelVersion)
	if got != want {
		t.Fatalf("upgrade.Encodings() = %q, want %q", got, want)
	}
	for _, p := range upgrade.Participants() {
		if p.Encoding == "" {
			t.Errorf("participant %s names no encoding for its objects", p.Name)
		}
	}
}

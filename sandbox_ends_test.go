package caddyktls

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// endOfTunnel is how a gateway saw its tunnel end.
type endOfTunnel struct {
	received int64
	readErr  error
	writeErr error
}

// pumpUntilClosed writes pattern bytes to c until a write fails while
// reading everything c returns, and reports both ends; the read gives up
// after 20s (an error that names the deadline).
func pumpUntilClosed(c net.Conn) <-chan endOfTunnel {
	out := make(chan endOfTunnel, 1)
	go func() {
		var end endOfTunnel
		werr := make(chan error, 1)
		go func() {
			_, err := io.Copy(c, forwardtest.NewPattern(4))
			werr <- err
		}()
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		end.received, end.readErr = io.Copy(io.Discard, c)
		c.Close()
		end.writeErr = <-werr
		out <- end
	}()
	return out
}

// checkClosedWithError checks that a tunnel of sandbox ended, was counted
// once with toSandbox and fromSandbox bytes, and was logged as ended with
// an error.
func checkClosedWithError(t *testing.T, e *sandboxEnv, sandbox string, toSandbox, fromSandbox int64) {
	t.Helper()
	waitIdle(t)
	a := activityOf(t, e, sandbox)
	if a.TotalTunnels != 1 || a.OpenTunnels != 0 || a.BytesToSandbox != toSandbox || a.BytesFromSandbox != fromSandbox {
		t.Errorf("activity of %s: %+v; want 1 closed tunnel with %d/%d bytes", sandbox, a, toSandbox, fromSandbox)
	}
	if e.waitTunnelEndError(t, sandbox) == "" {
		t.Errorf("no log line says the tunnel of %s ended with an error", sandbox)
	}
}

// The sandbox resets its connection mid-transfer: the tunnel ends, the
// gateway's connection is closed, and the bytes moved until then are
// counted.
func TestSandboxUpstreamResetMidTransfer(t *testing.T) { sandboxUpstreamResetMidTransfer(t, false) }

// TestKernelSandboxUpstreamResetMidTransfer is
// TestSandboxUpstreamResetMidTransfer on a kTLS kernel, where every byte
// counted must have been spliced.
func TestKernelSandboxUpstreamResetMidTransfer(t *testing.T) {
	kerneltest.Require(t)
	sandboxUpstreamResetMidTransfer(t, true)
}

// upstreamResetCase is one tunnel to a resetUpstream: its sandbox, the
// environment (leaks checked) and the data-path check of the kernel tests.
type upstreamResetCase struct {
	target       netip.AddrPort
	upReceived   <-chan int64
	sandbox      string
	e            *sandboxEnv
	splicedSince func() int64
}

func newUpstreamResetCase(t *testing.T, kernel bool, prefix string, send, atLeast int64) upstreamResetCase {
	t.Helper()
	var rc upstreamResetCase
	rc.target, rc.upReceived = resetUpstream(t, send, atLeast)
	rc.sandbox = uniqueSandbox(prefix)
	rc.e = newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	rc.splicedSince = dataPathCheck(t, kernel, 1)
	return rc
}

func sandboxUpstreamResetMidTransfer(t *testing.T, kernel bool) {
	const sent, readBeforeReset = 64 << 10, 256 << 10
	rc := newUpstreamResetCase(t, kernel, "sbx-upstream-rst", sent, readBeforeReset)
	e, sandbox, upReceived := rc.e, rc.sandbox, rc.upReceived
	end := <-pumpUntilClosed(e.dial(t, sandbox, rc.target))
	waitIdle(t)
	spliced := rc.splicedSince()
	if ne, ok := end.readErr.(net.Error); ok && ne.Timeout() {
		t.Fatalf("the gateway's connection stayed open after the sandbox reset: %v", end.readErr)
	}
	if end.writeErr == nil {
		t.Error("the gateway could write forever: its connection was not closed")
	}
	if end.received > sent {
		t.Errorf("the gateway received %d bytes; the sandbox sent %d", end.received, sent)
	}
	if got := <-upReceived; got != readBeforeReset {
		t.Fatalf("the sandbox read %d bytes before its reset, want %d", got, readBeforeReset)
	}
	// What reached the forwarder's socket before the reset is counted; the
	// bytes it relayed towards the sandbox are at least what the sandbox read.
	a := activityOf(t, e, sandbox)
	if a.BytesToSandbox < readBeforeReset {
		t.Errorf("counted %d bytes to the sandbox, but it read %d", a.BytesToSandbox, readBeforeReset)
	}
	// The sandbox's bytes race its reset, which ends both directions: the
	// relay counts what it wrote to the gateway, which the reset can cut
	// short, and the gateway cannot have received more than was counted.
	if a.BytesFromSandbox < end.received || a.BytesFromSandbox > sent {
		t.Errorf("counted %d bytes from the sandbox; it sent %d and the gateway received %d", a.BytesFromSandbox, sent, end.received)
	}
	checkClosedWithError(t, e, sandbox, a.BytesToSandbox, a.BytesFromSandbox)
	checkAllSpliced(t, kernel, spliced, a)
}

// The sandbox answers and then resets its connection while the gateway
// waits: the gateway reads the whole answer, then an error, where a
// close_notify would tell it the stream was complete (on the kernel path
// the fatal internal_error alert, sealed behind the answer; in userspace
// TLS a reset).
func TestSandboxUpstreamResetReachesGateway(t *testing.T) {
	sandboxUpstreamResetReachesGateway(t, false)
}

// TestKernelSandboxUpstreamResetReachesGateway is
// TestSandboxUpstreamResetReachesGateway on a kTLS kernel.
func TestKernelSandboxUpstreamResetReachesGateway(t *testing.T) {
	kerneltest.Require(t)
	sandboxUpstreamResetReachesGateway(t, true)
}

func sandboxUpstreamResetReachesGateway(t *testing.T, kernel bool) {
	rc := newUpstreamResetCase(t, kernel, "sbx-upstream-rst-answer", resetAnswer, resetRequest)
	e, sandbox := rc.e, rc.sandbox
	checkAnswerThenFailure(t, e.dial(t, sandbox, rc.target), kernel, rc.upReceived)
	a := activityOf(t, e, sandbox)
	checkClosedWithError(t, e, sandbox, resetRequest, resetAnswer)
	checkAllSpliced(t, kernel, rc.splicedSince(), a)
}

// checkAllSpliced checks, on a kTLS kernel, that the bytes spliced are
// exactly those counted for the sandbox a of the only tunnel that ran.
func checkAllSpliced(t *testing.T, kernel bool, spliced int64, a sandboxTotals) {
	t.Helper()
	if kernel && spliced != a.BytesToSandbox+a.BytesFromSandbox {
		t.Errorf("%d bytes spliced; the tunnel moved %d/%d", spliced, a.BytesToSandbox, a.BytesFromSandbox)
	}
}

// The gateway resets its connection mid-transfer: the tunnel ends, the
// sandbox's connection is closed while it is still sending, and exactly
// the bytes the gateway sent are counted towards the sandbox.
func TestSandboxGatewayResetMidTransfer(t *testing.T) { sandboxGatewayResetMidTransfer(t, false) }

// TestKernelSandboxGatewayResetMidTransfer is
// TestSandboxGatewayResetMidTransfer on a kTLS kernel, where every byte
// counted must have been spliced.
func TestKernelSandboxGatewayResetMidTransfer(t *testing.T) {
	kerneltest.Require(t)
	sandboxGatewayResetMidTransfer(t, true)
}

func sandboxGatewayResetMidTransfer(t *testing.T, kernel bool) {
	const sent = 256 << 10
	up := forwardtest.NewUpstream(t, 1<<40) // never finishes on its own
	sandbox := uniqueSandbox("sbx-gateway-rst")
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	splicedSince := dataPathCheck(t, kernel, 1)
	c := e.dial(t, sandbox, up.Addr())
	if _, err := io.Copy(c, io.LimitReader(forwardtest.NewPattern(5), sent)); err != nil {
		t.Fatal(err)
	}
	// Until the sandbox service has read them, not just the forwarder
	// written them: the reset that ends the tunnel also drops what its
	// socket holds unread.
	deadline := time.Now().Add(2 * time.Minute)
	for up.Received() < sent || activityOf(t, e, sandbox).BytesToSandbox < sent {
		if time.Now().After(deadline) {
			t.Fatalf("the sandbox never got the gateway's %d bytes: read %d, %+v", sent, up.Received(), activityOf(t, e, sandbox))
		}
		time.Sleep(5 * time.Millisecond)
	}
	tcp := c.NetConn().(*net.TCPConn)
	tcp.SetLinger(0)
	tcp.Close()
	waitIdle(t)
	spliced := splicedSince()
	up.Close() // returns once the sandbox's connection has ended
	r := up.Results()[0]
	if r.WriteErr == nil || r.Sent >= 1<<40 {
		t.Errorf("the sandbox sent %d bytes without an error: its connection was not closed", r.Sent)
	}
	if r.Received != sent || r.RecvSum != forwardtest.PatternSum(5, sent) {
		t.Errorf("the sandbox received %d bytes, want the gateway's %d", r.Received, sent)
	}
	a := activityOf(t, e, sandbox)
	checkClosedWithError(t, e, sandbox, sent, a.BytesFromSandbox)
	checkAllSpliced(t, kernel, spliced, a)
}

// TestKernelSandboxKeyWear: a tunnel's upload moves more records than the
// ktls handler's key_record_limit while its download streams (a paced
// upstream that answers until the upload ends: the forwarder can send
// KeyUpdates only until its own close_notify). With kernel rekey (TLS 1.3,
// Linux 6.14+) every byte arrives: the forwarder asks the gateway to renew
// its key (and renews its own, by the answer or at the limit), with
// KeyUpdates across the spliced relay. Without, the tunnel ends as a
// failure when a key reaches the limit, counted as key-exhausted, and
// nothing more than a relay batch past it is delivered.
func TestKernelSandboxKeyWear(t *testing.T) {
	kerneltest.Require(t)
	// 512 full records are 8 MiB: more than what can be in flight from the
	// gateway (its 64 KiB send buffer, the forwarder's receive buffer of at
	// most tcp_rmem's 6 MiB) when the forwarder asks it to renew.
	const limit, size = 512, 16 << 20
	up := forwardtest.NewPacedUpstream(t, 64<<10, 5*time.Millisecond)
	e := newSandboxConfig(t, nil)
	e.route()["handle"].([]any)[0].(map[string]any)["key_record_limit"] = limit
	e.start(t)
	before := ktls.Stats()
	c := e.dial(t, "sbx-wear", up.Addr())
	if err := c.NetConn().(*net.TCPConn).SetWriteBuffer(32 << 10); err != nil {
		t.Fatal(err)
	}
	// A liveness bound: a relay stuck on a key update is the bug this
	// test would otherwise hang on, so its goroutines are shown.
	watchdog := time.AfterFunc(3*time.Minute, func() {
		buf := make([]byte, 1<<20)
		t.Errorf("the tunnel did not end within 3 minutes; goroutines:\n%s", buf[:runtime.Stack(buf, true)])
		c.Close()
	})
	n, sum, err := transfer(c, size, 21)
	watchdog.Stop()
	waitIdle(t)
	up.Close()
	r := up.Results()[0]
	after := ktls.Stats()
	sent, applied, exhausted := after.KeyUpdatesSent-before.KeyUpdatesSent, after.KeyUpdates-before.KeyUpdates, after.KeyExhausted-before.KeyExhausted
	if ktls.Probe().Rekey {
		if err != nil || r.Received != size || r.RecvSum != forwardtest.PatternSum(21, size) || n != r.Sent || sum != r.SentSum {
			t.Fatalf("transfer %v: upstream got %d of %d, gateway got %d of %d, hashes match %v %v: want every byte across the rekeys",
				err, r.Received, size, n, r.Sent, r.RecvSum == forwardtest.PatternSum(21, size), sum == r.SentSum)
		}
		// 1,024 records up: the forwarder asked at least once (a KeyUpdate
		// sent) and applied the gateway's answer.
		if sent < 1 || applied < 1 || exhausted != 0 {
			t.Fatalf("KeyUpdates sent %d, applied %d, keys exhausted %d: want >= 1, >= 1, 0", sent, applied, exhausted)
		}
		t.Logf("%d MiB up, %d bytes down; %d KeyUpdates sent by the forwarder, %d applied", size>>20, n, sent, applied)
		return
	}
	if err == nil || (!strings.Contains(err.Error(), "remote error: tls: internal error") && !errors.Is(err, syscall.ECONNRESET)) {
		t.Fatalf("transfer ended with %v: want the failure end (internal_error or a reset)", err)
	}
	if exhausted != 1 || sent != 0 {
		t.Fatalf("keys exhausted %d, KeyUpdates sent %d: want 1, 0", exhausted, sent)
	}
	// Nothing the exhausted key would have sealed was sent, nor more than
	// a relay batch (16 records) past the limit opened.
	if n > limit<<14 || r.Received > (limit+16)<<14 {
		t.Fatalf("gateway got %d bytes, upstream %d: more than %d records' worth", n, r.Received, limit)
	}
	if r.RecvSum != forwardtest.PatternSum(21, r.Received) {
		t.Fatalf("the upstream's %d bytes are not the gateway's", r.Received)
	}
	lines := e.waitLogLine(t, "kTLS connection event", 0)
	if lines["event"] != "key-exhausted" {
		t.Fatalf("log %v: want the key-exhausted event at WARN", lines)
	}
}

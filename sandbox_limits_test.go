package caddyktls

import (
	"fmt"
	"io"
	"net"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/modules/forwarder"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// When the real binary runs out of file descriptors, a new tunnel fails
// cleanly (dial-failed: the gateway's TLS session is refused without a
// byte), the tunnels already open keep moving exact bytes, and once
// descriptors are free again new tunnels work: the accept loop survived
// EMFILE.
func TestSandboxFDExhaustion(t *testing.T) { sandboxFDExhaustion(t, false) }

// TestKernelSandboxFDExhaustion is TestSandboxFDExhaustion on a kTLS
// kernel, where a direction moving bytes also needs a pipe (2 fds) unless
// one is idle in the pool: a burst that finds none while the process is out
// of fds is copied through userspace instead (logged and counted), so every
// open tunnel still moves exact bytes. Recovery and the refusal are as on
// the host.
func TestKernelSandboxFDExhaustion(t *testing.T) {
	kerneltest.Require(t)
	sandboxFDExhaustion(t, true)
}

func sandboxFDExhaustion(t *testing.T, kernel bool) {
	const limit = 64
	reply := int64(256 << 10)
	up := forwardtest.NewUpstream(t, reply)
	e := newSandboxConfig(t, nil)
	server := e.cfg["apps"].(map[string]any)["layer4"].(map[string]any)["servers"].(map[string]any)["tunnels"].(map[string]any)
	server["listen"] = []string{acceptRetryNetwork + "/" + e.addr}
	p := startCaddy(t, e, fmt.Sprintf("ulimit -n %d", limit))
	fdsAtStart, pipesAtStart := p.openFDs(t)
	t.Logf("caddy holds %d fds (%d pipe ends) at start, limit %d", fdsAtStart, pipesAtStart, limit)

	// Open tunnels until one descriptor is left, so that the next tunnel's
	// accept(2) takes the last one and its dial fails. Each tunnel holds two
	// (gateway and upstream sockets), so the parity of the count at start
	// decides whether accept or dial runs out first: when two are left, a bare
	// TCP connection held in its TLS handshake (handshake_timeout, 10 s) takes
	// one. Counts are read once they settle, after transient descriptors (the
	// readiness probe's connection) are gone, and only below the limit: a
	// descriptor the process inherited above it (a test runner's pipe)
	// takes no room.
	var open []*ktls.Conn
	var held []net.Conn // connections that hold or queue for descriptors
	defer func() {
		for _, c := range open {
			c.Close()
		}
		for _, c := range held {
			c.Close()
		}
	}()
	for free := limit - p.settledFDs(t, limit); free != 1; free = limit - p.settledFDs(t, limit) {
		switch {
		case free == 0:
			// A descriptor appeared after the count that let the last
			// tunnel or filler in (seen on 7.3: one socket more than the
			// tunnels and fillers hold): give one back, the latest
			// filler's, or else the latest tunnel's two.
			if n := len(held); n > 0 {
				held[n-1].Close()
				held = held[:n-1]
			} else {
				open[len(open)-1].Close()
				open = open[:len(open)-1]
			}
		case free == 2:
			c, err := net.Dial("tcp", e.addr)
			if err != nil {
				t.Fatal(err)
			}
			held = append(held, c)
			deadline := time.Now().Add(10 * time.Second)
			for p.fdsBelow(t, limit) != limit-1 {
				if time.Now().After(deadline) {
					t.Fatalf("the filler connection was not accepted: caddy holds %d fds", p.fdsBelow(t, limit))
				}
				time.Sleep(5 * time.Millisecond)
			}
		default:
			accepted := up.Accepted()
			c, err := e.openTunnel(fmt.Sprintf("sbx-fd-%d", len(open)), up.Addr(), 5*time.Second)
			if err != nil {
				t.Fatalf("tunnel %d with %d fds free: the TLS handshake failed (%v)", len(open), free, err)
			}
			open = append(open, c)
			deadline := time.Now().Add(10 * time.Second)
			for up.Accepted() == accepted {
				if time.Now().After(deadline) || len(e.logLines(t, "sandbox tunnel rejected")) != 0 {
					t.Fatalf("tunnel %d with %d fds free was not dialed", len(open)-1, free)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
	}
	// One descriptor left: accepted, then refused (dial-failed) without a
	// byte.
	filled := p.fdSummary()
	c, err := e.openTunnel("sbx-fd-refused", up.Addr(), 5*time.Second)
	if err != nil {
		t.Fatalf("the tunnel on the last descriptor: the TLS handshake failed (%v); caddy held %s, now %d below the limit: %s",
			err, filled, p.fdsBelow(t, limit), p.fdSummary())
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, c); n != 0 {
		t.Errorf("refused tunnel: read %d bytes, err %v; want none", n, err)
	} else {
		checkGatewayEnd(t, err, kernel, true)
	}
	c.Close()
	rejected := e.logLines(t, "sandbox tunnel rejected")
	for deadline := time.Now().Add(5 * time.Second); len(rejected) == 0 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
		rejected = e.logLines(t, "sandbox tunnel rejected")
	}
	if len(rejected) != 1 || rejected[0]["reason"] != "dial-failed" {
		t.Fatalf("rejections logged %v, want one dial-failed", rejected)
	}
	fds, pipes := p.openFDs(t)
	t.Logf("%d tunnels open (%d filler connections), then dial-failed; caddy holds %d fds (%d pipe ends)", len(open), len(held), fds, pipes)

	// Hold the last descriptors with bare TCP connections that never
	// start a handshake: the next accept(2) fails with EMFILE.
	for range 4 {
		c, err := net.Dial("tcp", e.addr)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	const retrying = "accept failed for lack of resources; retrying"
	deadline := time.Now().Add(10 * time.Second)
	for len(e.logLines(t, retrying)) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("accept never failed for lack of fds")
		}
		time.Sleep(10 * time.Millisecond)
	}

	// The open tunnels are unaffected.
	var wg sync.WaitGroup
	errs := make([]error, len(open))
	sums := make([][32]byte, len(open))
	for i, c := range open {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var n int64
			n, sums[i], errs[i] = transfer(c, 64<<10, uint64(1000+i))
			if errs[i] == nil && n != reply {
				errs[i] = fmt.Errorf("received %d bytes, want %d", n, reply)
			}
		}()
	}
	wg.Wait()
	open = nil
	for i, err := range errs {
		if err != nil || sums[i] != forwardtest.PatternSum(2, reply) {
			t.Errorf("open tunnel %d while out of fds: err %v, reply hash matches: %v", i, err, sums[i] == forwardtest.PatternSum(2, reply))
		}
	}
	// Every tunnel ended in order. On the kernel path, bursts that found
	// no pipe were copied through userspace (the pool's idle pipes serve
	// many, so how many is up to timing): each tunnel that had any says so
	// once, with the count that the metric adds up (checked below). The
	// host path copies anyway and needs no pipe.
	deadline = time.Now().Add(10 * time.Second)
	for {
		var all []forward.TunnelInfo
		e.adminGet(t, "/sandbox/tunnels", &all)
		if len(all) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d tunnels still open after their gateways closed: %+v", len(all), all)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if ended := e.logLines(t, "sandbox tunnel ended with an error"); len(ended) != 0 {
		t.Errorf("tunnels ended with an error while out of fds: %v", ended)
	}
	for _, c := range held {
		c.Close()
	}
	held = nil

	// Recovery: descriptors are free again, new tunnels work.
	var n int64
	var sum [32]byte
	deadline = time.Now().Add(10 * time.Second)
	for {
		if c, err = e.openTunnel("sbx-fd-after", up.Addr(), 3*time.Second); err == nil {
			if n, sum, err = transfer(c, 1000, 5); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no tunnel after the descriptors came back: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if n != reply || sum != forwardtest.PatternSum(2, reply) {
		t.Errorf("tunnel after recovery: %d bytes, hash matches: %v", n, sum == forwardtest.PatternSum(2, reply))
	}
	// The shortages were counted, the refusal too, and the descriptors are
	// back to where they started.
	var shortages int64
	short := e.logLines(t, "sandbox tunnel found no file descriptors for pipes; those bursts were copied through userspace")
	for _, l := range short {
		n, _ := l["pipe_shortages"].(float64)
		shortages += int64(n)
	}
	if !kernel && len(short) != 0 {
		t.Errorf("the copy path reported pipe shortages: %v", short)
	}
	t.Logf("%d of %d open tunnels copied %d bursts for want of a pipe", len(short), len(errs), shortages)
	metrics := string(e.adminBody(t, "/metrics"))
	for _, re := range []string{`(?m)^caddy_ktls_accept_retries_total [1-9]`, `(?m)^caddy_ktls_sandbox_rejects_total\{reason="dial-failed"\} 1$`,
		fmt.Sprintf(`(?m)^caddy_ktls_relay_pipe_shortages_total %d$`, shortages)} {
		if !regexp.MustCompile(re).MatchString(metrics) {
			t.Errorf("/metrics does not match %s", re)
		}
	}
	// Besides the splice pool's idle pipes (at most DefaultMaxIdlePipes,
	// two ends each, kept for reuse).
	deadline = time.Now().Add(5 * time.Second)
	for fds, pipes := p.openFDs(t); fds-pipes > fdsAtStart-pipesAtStart || pipes > pipesAtStart+2*splice.DefaultMaxIdlePipes; fds, pipes = p.openFDs(t) {
		if time.Now().After(deadline) {
			t.Fatalf("caddy holds %d fds (%d pipe ends) after the tunnels closed, %d (%d) at start", fds, pipes, fdsAtStart, pipesAtStart)
		}
		time.Sleep(20 * time.Millisecond)
	}
	up.Close()
	got := map[[32]byte]int64{}
	for _, r := range up.Results() {
		got[r.RecvSum] = r.Received
	}
	for i := range errs {
		if got[forwardtest.PatternSum(uint64(1000+i), 64<<10)] != 64<<10 {
			t.Errorf("upstream did not receive tunnel %d's bytes", i)
		}
	}
	if got[forwardtest.PatternSum(5, 1000)] != 1000 {
		t.Errorf("upstream did not receive the recovered tunnel's bytes")
	}
}

// max_tunnels_per_sandbox caps one sandbox's open tunnels: one more is
// refused (tunnel-limit) before its target is dialed, logged and counted,
// while another sandbox's tunnel opens, and so does the sandbox's own once
// one of its tunnels has ended.
func TestSandboxTunnelLimit(t *testing.T) { sandboxTunnelLimit(t, false) }

// TestKernelSandboxTunnelLimit is TestSandboxTunnelLimit on a kTLS kernel,
// where the refusal is the access_denied alert.
func TestKernelSandboxTunnelLimit(t *testing.T) {
	kerneltest.Require(t)
	sandboxTunnelLimit(t, true)
}

func sandboxTunnelLimit(t *testing.T, kernel bool) {
	const reply = 1000
	up := forwardtest.NewUpstream(t, reply)
	sandbox, other := uniqueSandbox("sbx-limit"), uniqueSandbox("sbx-limit-other")
	e := newSandboxEnv(t, map[string]any{"max_tunnels_per_sandbox": 2})
	forwardtest.CheckLeaks(t)
	before := forwarder.Tunnels().RefusedTunnels()[string(forward.ReasonTunnelLimit)]
	metrics0 := e.metrics(t)
	held := []*ktls.Conn{e.dial(t, sandbox, up.Addr()), e.dial(t, sandbox, up.Addr())}
	waitUntil(t, 10*time.Second, func() bool { return up.Accepted() == 2 }, "both tunnels to be dialed")
	logged := len(e.logLines(t, rejectedMsg))

	c := e.dial(t, sandbox, up.Addr())
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, c); n != 0 {
		t.Errorf("the tunnel over the cap read %d bytes (err %v); want none", n, err)
	} else {
		checkGatewayEnd(t, err, kernel, true)
	}
	c.Close()
	waitRejections(t, string(forward.ReasonTunnelLimit), before+1)
	if l := e.waitLogLine(t, rejectedMsg, logged); l["reason"] != string(forward.ReasonTunnelLimit) || l["client_certificate"] != gatewaySubject ||
		!strings.Contains(fmt.Sprint(l["error"]), "has 2 tunnels open") {
		t.Errorf("log line %v, want a tunnel-limit rejection of %s saying the sandbox has 2 tunnels open", l, gatewaySubject)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{`caddy_ktls_sandbox_rejects_total{reason="tunnel-limit"}`: 1})
	if n := up.Accepted(); n != 2 {
		t.Errorf("the target was dialed %d times, want 2: the refused tunnel must not dial", n)
	}

	through := func(c *ktls.Conn, seed uint64) {
		t.Helper()
		if n, sum, err := transfer(c, 500, seed); err != nil || n != reply || sum != forwardtest.PatternSum(2, reply) {
			t.Errorf("tunnel (seed %d): %d bytes back, hash matches %v, err %v; want the %d-byte reply", seed, n, sum == forwardtest.PatternSum(2, reply), err, reply)
		}
	}
	through(e.dial(t, other, up.Addr()), 1)
	through(held[0], 2)
	waitUntil(t, 10*time.Second, func() bool { return activityOf(t, e, sandbox).OpenTunnels == 1 }, "the ended tunnel to leave the count")
	through(e.dial(t, sandbox, up.Addr()), 3)
	through(held[1], 4)
	waitIdle(t)
}

// max_tunnel_lifetime ends a tunnel still moving bytes at that age as a
// failure: the gateway reads what the target sent, then the failure (a
// reset in userspace TLS, internal_error on kTLS), never close_notify; the
// end is logged with the reason and counted.
func TestSandboxTunnelLifetime(t *testing.T) { sandboxTunnelLifetime(t, false) }

// TestKernelSandboxTunnelLifetime is TestSandboxTunnelLifetime on a kTLS
// kernel.
func TestKernelSandboxTunnelLifetime(t *testing.T) {
	kerneltest.Require(t)
	sandboxTunnelLifetime(t, true)
}

func sandboxTunnelLifetime(t *testing.T, kernel bool) {
	const lifetime = 500 * time.Millisecond
	target := tricklingUpstream(t, 1<<10, 20*time.Millisecond)
	e := newSandboxEnv(t, map[string]any{"max_tunnel_lifetime": lifetime.String()})
	forwardtest.CheckLeaks(t)
	expired := forwarder.Tunnels().Expired()
	metrics0 := e.metrics(t)
	// The lifetime starts when the forwarder opens the tunnel, which can be
	// before the gateway's dial returns: the tunnel cannot end earlier than
	// lifetime after the dial began.
	start := time.Now()
	c := e.dial(t, uniqueSandbox("sbx-lifetime"), target)
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := io.Copy(io.Discard, c)
	err = sockerr.ReadError(c, err)
	if age := time.Since(start); n == 0 || age < lifetime {
		t.Errorf("the gateway read %d bytes in %v; want the trickle for the %v lifetime", n, age, lifetime)
	}
	checkGatewayEnd(t, err, kernel, false)
	l := e.waitLogLine(t, "sandbox tunnel ended with an error", 0)
	if !strings.Contains(fmt.Sprint(l["error"]), "the tunnel reached its lifetime of 500ms") || l["client_certificate"] != gatewaySubject {
		t.Errorf("log line %v, want the lifetime named as the end of %s's tunnel", l, gatewaySubject)
	}
	waitIdle(t)
	if got := forwarder.Tunnels().Expired() - expired; got != 1 {
		t.Errorf("%d tunnels counted as expired, want 1", got)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{"caddy_ktls_sandbox_tunnels_expired_total": 1})
}

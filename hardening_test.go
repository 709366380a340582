package caddyktls

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// closesMetric gathers caddy_ktls_connections_closed_total through a
// registry, as Prometheus scrapes it, keyed by "module event".
func closesMetric(t *testing.T) map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(metrics); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if f.GetName() != "caddy_ktls_connections_closed_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			var module, event string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "module":
					module = l.GetValue()
				case "event":
					event = l.GetValue()
				}
			}
			out[module+" "+event] = m.GetCounter().GetValue()
		}
	}
	return out
}

// A connection the ktls engine closes for a KeyUpdate storm (or a peer
// alert, or a failure after TLS_TX) is logged at WARN with the peer and
// counted per module in caddy_ktls_connections_closed_total; every series
// exists from the start. The events come in through the modules' observers,
// the path the engine reports them on (a real storm needs a kTLS kernel:
// TestKernelKeyUpdateFlood).
func TestConnectionCloseEventsCounted(t *testing.T) {
	before := closesMetric(t)
	for _, m := range []string{moduleL4Handler, moduleListenerWrapper} {
		for _, ev := range closeEvents {
			if _, ok := before[m+" "+string(ev)]; !ok {
				t.Errorf("no series for %s %s before any close", m, ev)
			}
		}
	}
	peer := &net.TCPAddr{IP: net.IPv4(192, 0, 2, 7), Port: 40000}
	core, logs := observer.New(zapcore.DebugLevel)
	h := &KTLSHandler{logger: zap.New(core)}
	lw := &ListenerWrapper{logger: zap.New(core)}
	for _, observe := range []func(ktls.Event){h.observe, lw.observe} {
		observe(ktls.Event{Kind: ktls.EventRateLimited, Remote: peer, Err: ktls.ErrKeyUpdateRateLimited})
		observe(ktls.Event{Kind: ktls.EventRateLimited, Remote: peer, Err: ktls.ErrKeyUpdateRateLimited})
		observe(ktls.Event{Kind: ktls.EventKeyUpdate, Remote: peer}) // applied: not a close
	}
	h.observe(ktls.Event{Kind: ktls.EventAlert, Remote: peer, Err: ktls.AlertError(20)})
	lw.observe(ktls.Event{Kind: ktls.EventRekeyUnsupported, Remote: peer, Err: ktls.ErrRekeyUnsupported})

	after := closesMetric(t)
	for key, want := range map[string]float64{
		moduleL4Handler + " rate-limited":            2,
		moduleListenerWrapper + " rate-limited":      2,
		moduleL4Handler + " alert":                   1,
		moduleListenerWrapper + " alert":             0,
		moduleL4Handler + " closed-after-tx":         0,
		moduleListenerWrapper + " rekey-unsupported": 1,
		moduleL4Handler + " rekey-unsupported":       0,
	} {
		if got := after[key] - before[key]; got != want {
			t.Errorf("%s: counted %v, want %v", key, got, want)
		}
	}
	if len(after) != 2*len(closeEvents)+1 {
		t.Errorf("series %v, want exactly modules x close events, and bad-record for layer4", after)
	}
	if _, ok := before[moduleL4Handler+" "+string(eventBadRecord)]; !ok {
		t.Errorf("no layer4 bad-record series before any close")
	}
	warned := 0
	for _, e := range logs.FilterLevelExact(zapcore.WarnLevel).All() {
		fields := e.ContextMap()
		if fields["event"] == string(ktls.EventRateLimited) {
			warned++
			if fields["remote"] != peer.String() {
				t.Errorf("rate-limit WARN without the peer: %v", fields)
			}
		}
	}
	if warned != 4 {
		t.Errorf("%d rate-limit WARN lines, want 4 (2 per module)", warned)
	}
}

// TestHandshakeEventReachesObserver: the layer4 handler's engine reports
// each handshake to the module's observer (where close events are counted
// too): one DEBUG "kernel TLS handshake" line per connection, naming its
// peer and, as the engine saw them, where its records go. On this host the
// session stays in userspace TLS, the one event a host can produce.
func TestHandshakeEventReachesObserver(t *testing.T) { handshakeEventReachesObserver(t, false) }

// TestKernelHandshakeEventReachesObserver is the same on a kTLS kernel:
// both directions in the kernel.
func TestKernelHandshakeEventReachesObserver(t *testing.T) {
	kerneltest.Require(t)
	handshakeEventReachesObserver(t, true)
}

func handshakeEventReachesObserver(t *testing.T, kernel bool) {
	const size = 1000
	up := forwardtest.NewUpstream(t, size)
	e := newSandboxConfig(t, nil)
	e.cfg["logging"].(map[string]any)["logs"].(map[string]any)["default"].(map[string]any)["level"] = "DEBUG"
	e.start(t)
	c := e.dial(t, "sbx-observed", up.Addr())
	local := c.LocalAddr().String()
	if n, sum, err := transfer(c, size, 1); err != nil || n != size || sum != forwardtest.PatternSum(2, size) {
		t.Fatalf("tunnel: received %d of %d bytes (hash ok: %v), err %v", n, size, sum == forwardtest.PatternSum(2, size), err)
	}
	want := map[string]any{"logger": "layer4.handlers.ktls", "remote": local, "version": "TLS 1.3",
		"tx": "userspace", "rx": "userspace", "reason": string(ktls.ReasonNoKernelSupport), "rx_no_pad": false}
	if kernel {
		want["tx"], want["rx"], want["reason"] = "sw", "sw", string(ktls.ReasonNone)
	}
	var got []map[string]any
	for _, l := range e.logLines(t, "kernel TLS handshake") {
		if l["remote"] == local {
			got = append(got, l)
		}
	}
	if len(got) != 1 {
		t.Fatalf("%d handshake log lines for %s, want 1: %v", len(got), local, got)
	}
	for k, v := range want {
		if got[0][k] != v {
			t.Errorf("handshake log line %v: %s = %v, want %v", got[0], k, got[0][k], v)
		}
	}
}

// caddyProcess is the real binary running a sandboxEnv's configuration.
type caddyProcess struct {
	cmd     *exec.Cmd
	exited  chan struct{} // closed when the process has exited (exitErr)
	exitErr error
}

// exitedAfterDrain waits for the process to exit 0 after a drain that
// closed forced tunnels when its grace period ran out, as one log line says.
func (p *caddyProcess) exitedAfterDrain(t *testing.T, e *sandboxEnv, forced int) {
	t.Helper()
	select {
	case <-p.exited:
		if p.exitErr != nil {
			t.Errorf("caddy exited with %v", p.exitErr)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("caddy did not exit after the drain")
	}
	lines := e.logLines(t, "closed tunnels still open after the drain grace period")
	if len(lines) != 1 || lines[0]["tunnels"] != float64(forced) {
		t.Errorf("drain log lines %v, want one that closed %d tunnels", lines, forced)
	}
}

// startCaddy runs bin/caddy with e's configuration, after the shell
// commands in prelude (e.g. "ulimit -n 64"), waits until the layer4
// listener accepts, and kills the process at cleanup if it still runs.
func startCaddy(t *testing.T, e *sandboxEnv, prelude string) *caddyProcess {
	t.Helper()
	cfg, err := json.Marshal(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfgFile := filepath.Join(t.TempDir(), "caddy.json")
	if err := os.WriteFile(cfgFile, cfg, 0o600); err != nil {
		t.Fatal(err)
	}
	return runCaddy(t, prelude, e.addr, e.logFile, "--config", cfgFile)
}

// runCaddy runs `bin/caddy run` with args (the configuration) after the
// shell commands in prelude, waits until addr accepts TCP connections, and
// kills the process at cleanup if it still runs. When t fails, the
// process's output and the tail of logFile (its configured log) are logged.
func runCaddy(t *testing.T, prelude, addr, logFile string, args ...string) *caddyProcess {
	t.Helper()
	caddyBin := builtCaddy(t)
	output := new(syncBuffer)
	cmd := exec.Command("/bin/sh", append([]string{"-c", prelude + `
exec "$0" run "$@"`, caddyBin}, args...)...)
	cmd.Stdout, cmd.Stderr = output, output
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &caddyProcess{cmd: cmd, exited: make(chan struct{})}
	go func() {
		p.exitErr = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			cmd.Process.Kill()
			<-p.exited
		}
		if t.Failed() {
			log, _ := os.ReadFile(logFile)
			t.Logf("caddy output:\n%s\ncaddy log (tail):\n%s", output.String(), tail(log, 64<<10))
		}
	})
	deadline := time.Now().Add(15 * time.Second)
	for !connectable(addr) {
		if time.Now().After(deadline) {
			t.Fatal("caddy never listened")
		}
		time.Sleep(20 * time.Millisecond)
	}
	return p
}

// connectable reports whether a TCP listener accepts at addr.
func connectable(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err == nil {
		c.Close()
	}
	return err == nil
}

// settledFDs waits until the number of the process's descriptors below
// limit holds still for 100 ms (connections being closed are gone) and
// returns it.
func (p *caddyProcess) settledFDs(t *testing.T, limit int) int {
	t.Helper()
	n, still := p.fdsBelow(t, limit), 0
	for deadline := time.Now().Add(5 * time.Second); still < 5 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		if m := p.fdsBelow(t, limit); m == n {
			still++
		} else {
			n, still = m, 0
		}
	}
	return n
}

// openFDs counts the process's open file descriptors, and those of them
// that are pipe ends.
func (p *caddyProcess) openFDs(t *testing.T) (fds, pipes int) {
	t.Helper()
	targets, err := p.fdTargets()
	if err != nil {
		t.Fatalf("count caddy's fds: %v", err)
	}
	for _, target := range targets {
		if strings.HasPrefix(target, "pipe:") {
			pipes++
		}
	}
	return len(targets), pipes
}

// fdSummary lists the process's open descriptors by what they are (socket,
// pipe, anon_inode:[eventpoll], a file's path), for failure messages.
func (p *caddyProcess) fdSummary() string {
	targets, err := p.fdTargets()
	if err != nil {
		return err.Error()
	}
	kinds := map[string]int{}
	for _, target := range targets {
		kind, _, _ := strings.Cut(target, ":[")
		kinds[kind]++
	}
	return fmt.Sprint(kinds)
}

// fdTargets returns what each of the process's open descriptors refers to
// ("socket:[123]", "pipe:[456]", a path).
func (p *caddyProcess) fdTargets() ([]string, error) {
	dir := fmt.Sprintf("/proc/%d/fd", p.cmd.Process.Pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var targets []string
	for _, e := range ents {
		// A descriptor closed since ReadDir is left out.
		if target, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil {
			targets = append(targets, target)
		}
	}
	return targets, nil
}

// fdsBelow counts the process's open descriptors numbered below limit: the
// room RLIMIT_NOFILE leaves is limit minus this count.
func (p *caddyProcess) fdsBelow(t *testing.T, limit int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.cmd.Process.Pid))
	if err != nil {
		t.Fatalf("count caddy's fds: %v", err)
	}
	n := 0
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd < limit {
			n++
		}
	}
	return n
}

// syncBuffer is an io.Writer for a subprocess's output that the test may
// read while the process still writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// tail returns the last n bytes of b.
func tail(b []byte, n int) []byte {
	return b[max(len(b)-n, 0):]
}

// openTunnel is dial with a deadline and an error instead of a test failure.
func (e *sandboxEnv) openTunnel(sandbox string, target netip.AddrPort, timeout time.Duration) (*tls.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return preamble.Dial(ctx, "tcp", e.addr, e.tlsConfig(e.client), e.gw.Signer, preamble.Claims{SandboxID: sandbox, Target: target})
}

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
	var open []*tls.Conn
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

// SIGTERM with 100 tunnels moving data: the real binary stops accepting at
// once, lets the tunnels that finish within drain_grace_period finish with
// every byte intact, closes the rest after it, and exits 0.
func TestSandboxDrainManyTunnels(t *testing.T) { sandboxDrainManyTunnels(t, false) }

// TestKernelSandboxDrainManyTunnels is TestSandboxDrainManyTunnels on a
// kTLS kernel (every tunnel offloaded: tls_stat), with 20 tunnels paced at
// a chunk every 100 ms: the VM emulates the CPU (AES included), and at the
// host's 2,000 records a second its one vCPU, when the host is loaded,
// fell seconds behind the gateways and past the grace period's checks.
func TestKernelSandboxDrainManyTunnels(t *testing.T) {
	kerneltest.Require(t)
	sandboxDrainManyTunnels(t, true)
}

func sandboxDrainManyTunnels(t *testing.T, kernel bool) {
	const (
		grace = 6 * time.Second
		chunk = 1 << 10 // every pace per tunnel: 100 tunnels must not starve 2 cores
		reply = 256 << 10
	)
	finishing, streaming := 50, 50 // end their transfer shortly after SIGTERM; would stream forever: closed by the drain
	pace := 20 * time.Millisecond
	if kernel {
		finishing, streaming = 10, 10
		pace = 100 * time.Millisecond
	}
	finite := forwardtest.NewUpstream(t, reply)
	endless := tricklingUpstream(t, chunk, pace)
	e := newSandboxConfig(t, map[string]any{"drain_grace_period": grace.String()})
	p := startCaddy(t, e, "")
	since := dataPathDelta(t, kernel) // tls_stat counts the binary's installs too: one network namespace

	finish := make(chan struct{}) // closed shortly after SIGTERM: the finishing tunnels end
	var finished []<-chan streamOutcome
	var moving atomic.Int64    // bytes the streaming tunnels received
	var streamers atomic.Int64 // streaming tunnels that received bytes
	streamEnded := make(chan error, streaming)
	for i := range finishing {
		c := e.dial(t, fmt.Sprintf("sbx-drain-fin-%d", i), finite.Addr())
		finished = append(finished, pacedStream(c, uint64(300+i), chunk, pace, finish))
	}
	for i := range streaming {
		c := e.dial(t, fmt.Sprintf("sbx-drain-str-%d", i), endless)
		go func() {
			defer c.Close()
			// Unpaced: the upstream paces, so nothing piles up in socket
			// buffers and the drain's close is seen at once.
			buf := make([]byte, 16<<10)
			for first := true; ; first = false {
				n, err := c.Read(buf)
				if first && err == nil {
					streamers.Add(1)
				}
				moving.Add(int64(n))
				if err != nil {
					streamEnded <- err
					return
				}
			}
		}()
	}
	deadline := time.Now().Add(60 * time.Second)
	// Every tunnel is open (a preamble still in flight at SIGTERM would be
	// refused as "draining").
	for streamers.Load() < int64(streaming) || finite.Accepted() < finishing {
		if time.Now().After(deadline) {
			t.Fatalf("tunnels did not start moving: %d streaming, %d finishing tunnels dialed", streamers.Load(), finite.Accepted())
		}
		time.Sleep(10 * time.Millisecond)
	}

	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	// New connections are refused during the drain.
	deadline = time.Now().Add(5 * time.Second)
	for connectable(e.addr) {
		if time.Now().After(deadline) {
			t.Fatal("caddy still accepts connections after SIGTERM")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if c, err := e.openTunnel("sbx-drain-late", finite.Addr(), 2*time.Second); err == nil {
		c.Close()
		t.Error("a tunnel opened during the drain")
	}
	at := moving.Load()
	// The drain began once the listener closed (the handler's Cleanup
	// runs after it): for half the grace period from then, every streaming
	// tunnel stays alive and moving. (Counted from here, not from SIGTERM:
	// a loaded VM took over 2 s to close the listener.)
	close(finish)
	select {
	case err := <-streamEnded:
		t.Fatalf("a streaming tunnel ended within half the grace period: %v", err)
	case <-time.After(grace / 2):
	}
	if moving.Load() == at {
		t.Error("the streaming tunnels moved no bytes during the drain")
	}
	// The finishing tunnels end whole: had the drain cut one at the grace
	// period, its bytes would be short. (No tighter deadline: under -race
	// on a loaded 2-core host, 50 of them took more than half the grace
	// period to finish.)
	var outcomes []streamOutcome
	for _, done := range finished {
		select {
		case o := <-done:
			outcomes = append(outcomes, o)
			if o.err != nil || o.recv != reply || o.recvSum != forwardtest.PatternSum(2, reply) {
				t.Errorf("finishing tunnel: received %d of %d bytes (hash ok: %v), err %v", o.recv, reply, o.recvSum == forwardtest.PatternSum(2, reply), o.err)
			}
		case <-time.After(grace + 10*time.Second):
			t.Fatal("a finishing tunnel is still open long after the grace period")
		}
	}
	for range streaming {
		select {
		case err := <-streamEnded:
			// Cut by the drain, the stream is not complete, and the
			// gateway must not read it as complete (a close_notify).
			if errors.Is(err, io.EOF) {
				t.Error("a streaming tunnel cut by the drain ended in order, as if its stream were complete")
			}
		case <-time.After(grace + 10*time.Second):
			t.Fatal("a streaming tunnel is still open long after the grace period")
		}
	}
	p.exitedAfterDrain(t, e, streaming)
	finite.Close()
	if n := len(finite.Results()); n != finishing {
		t.Errorf("upstream saw %d finishing tunnels, want %d (a late tunnel was dialed?)", n, finishing)
	}
	checkBothWays(t, finite, outcomes)
	// At least: the binary's own capability probe installs keys too.
	if stat, _ := since(); kernel && (stat["TlsTxSw"] < int64(finishing+streaming) || stat["TlsRxSw"] < int64(finishing+streaming) || stat["TlsDecryptError"] != 0) {
		t.Errorf("tls_stat delta %v: want TlsTxSw and TlsRxSw >= %d (every tunnel offloaded), TlsDecryptError 0", stat, finishing+streaming)
	}
}

// SIGTERM while a gateway has stopped reading a tunnel whose sandbox keeps
// sending: the drain cuts the tunnel at the end of drain_grace_period without
// waiting on that gateway (a close_notify would wait up to its 5 s write
// deadline), the process exits, and the gateway reads a failure, never an
// orderly end. The test waits until the gateway's receive queue has stopped
// growing, so the forwarder is blocked on it, before it signals.
func TestSandboxDrainStalledGateway(t *testing.T) { sandboxDrainStalledGateway(t, false) }

// TestKernelSandboxDrainStalledGateway is TestSandboxDrainStalledGateway
// with the tunnel offloaded. What the gateway reads is a reset where the
// internal_error alert finds no room in the forwarder's send queue, the alert
// where the kernel has freed enough of it: both are failures, and which one
// depends on how far the queues drained, not on the product.
func TestKernelSandboxDrainStalledGateway(t *testing.T) {
	kerneltest.Require(t)
	sandboxDrainStalledGateway(t, true)
}

func sandboxDrainStalledGateway(t *testing.T, kernel bool) {
	const grace = 2 * time.Second
	up := forwardtest.NewUpstream(t, 1<<40)
	e := newSandboxConfig(t, map[string]any{"drain_grace_period": grace.String()})
	p := startCaddy(t, e, "")
	since := dataPathDelta(t, kernel)
	c := e.dial(t, "sbx-drain-stalled", up.Addr())
	defer c.Close()
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	queued := awaitReceiveQueueStalled(t, c.NetConn().(*net.TCPConn))
	t.Logf("the gateway's receive queue holds %d bytes and stopped growing", queued)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	// A bound on the exit, not a speed: the 5 s of a blocked close_notify
	// would take it past grace + 5 s.
	select {
	case <-p.exited:
	case <-time.After(grace + 4*time.Second):
		t.Fatalf("caddy still runs %v after SIGTERM with drain_grace_period %v: the stalled gateway holds the exit", time.Since(sent).Round(time.Millisecond), grace)
	}
	t.Logf("caddy exited %v after SIGTERM (drain_grace_period %v)", time.Since(sent).Round(time.Millisecond), grace)
	p.exitedAfterDrain(t, e, 1)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := io.Copy(io.Discard, c)
	reset := errors.Is(err, syscall.ECONNRESET)
	alert := err != nil && strings.Contains(err.Error(), "remote error: tls: internal error")
	switch {
	case !kernel && !reset:
		t.Errorf("the stalled gateway's read ended with %v, want a reset (userspace TLS)", err)
	case kernel && !reset && !alert:
		t.Errorf("the stalled gateway's read ended with %v, want a failure: a reset or the internal_error alert", err)
	}
	t.Logf("the stalled gateway's read ended with %v", err)
	if stat, _ := since(); kernel && (stat["TlsTxSw"] < 1 || stat["TlsRxSw"] < 1) {
		t.Errorf("tls_stat delta %v: the tunnel was not offloaded", stat)
	}
}

// Slowloris at scale: hundreds of gateways' sessions each dribble a valid
// preamble one byte per second. Every one is cut at preamble_timeout with
// reason "timeout" (logged with the peer, counted), nothing is dialed for
// them, a normal tunnel opened during the attack works, and every fd and
// goroutine is released after.
func TestSandboxSlowlorisPreambles(t *testing.T) { sandboxSlowlorisPreambles(t, false) }

// TestKernelSandboxSlowlorisPreambles is TestSandboxSlowlorisPreambles on a
// kTLS kernel, where the dribbled preamble is read through kTLS RX: every
// slow session was offloaded (tls_stat) before it was cut.
func TestKernelSandboxSlowlorisPreambles(t *testing.T) {
	kerneltest.Require(t)
	sandboxSlowlorisPreambles(t, true)
}

func sandboxSlowlorisPreambles(t *testing.T, kernel bool) {
	slow := 500
	switch {
	case kernel:
		// The VM emulates the CPU (handshakes and AES ~250x slower); the
		// kernel facts (offloaded, then cut) do not need the scale.
		slow = 40
	case forwardtest.RaceEnabled:
		slow = 200 // the race detector makes each handshake ~10x dearer
	}
	size := int64(1 << 20)
	up := forwardtest.NewUpstream(t, size+3)
	e := newSandboxEnv(t, map[string]any{"preamble_timeout": "2s"})
	forwardtest.CheckLeaks(t)
	before := tunnels.Rejections()["timeout"]
	since := dataPathDelta(t, kernel)

	frame := e.gw.Frame(t, "sbx-slow", up.Addr())
	var wg sync.WaitGroup
	var dribbling sync.WaitGroup // until every slow session started to dribble
	read := make(chan int64, slow)
	handshakes := make(chan struct{}, 32) // bounded concurrent handshakes
	dribbling.Add(slow)
	for range slow {
		wg.Add(1)
		go func() {
			defer wg.Done()
			handshakes <- struct{}{}
			c, err := tls.Dial("tcp", e.addr, e.tlsConfig(e.client))
			<-handshakes
			dribbling.Done()
			if err != nil {
				t.Errorf("slow session handshake: %v", err)
				return
			}
			defer c.Close()
			done := make(chan struct{})
			go func() {
				defer close(done)
				c.SetReadDeadline(time.Now().Add(2 * time.Minute)) // liveness only
				n, _ := io.Copy(io.Discard, c)
				read <- n
			}()
			tick := time.NewTicker(time.Second)
			defer tick.Stop()
		dribble:
			for i := range frame {
				if _, err := c.Write(frame[i : i+1]); err != nil {
					break
				}
				select {
				case <-done: // cut off
					break dribble
				case <-tick.C:
				}
			}
			<-done
		}()
	}
	dribbling.Wait()
	// A normal tunnel during the attack.
	n, recvSum, err := transfer(e.dial(t, "sbx-during-slowloris", up.Addr()), size, 9)
	if err != nil {
		t.Errorf("tunnel during the attack: %v", err)
	}
	wg.Wait()
	close(read)
	for n := range read {
		if n != 0 {
			t.Errorf("a slow session read %d bytes; want none", n)
		}
	}
	waitRejections(t, "timeout", before+uint64(slow))
	checkTunnelTransfer(t, up, size, 9, n, recvSum)
	if up.Accepted() != 1 {
		t.Errorf("upstream accepted %d connections, want only the normal tunnel's", up.Accepted())
	}
	logged := 0
	for _, l := range e.logLines(t, "sandbox tunnel rejected") {
		if l["reason"] == "timeout" && l["peer"] != "" {
			logged++
		}
	}
	if logged != slow {
		t.Errorf("%d timeout log lines with a peer, want %d", logged, slow)
	}
	if stat, _ := since(); kernel && (stat["TlsTxSw"] != int64(slow)+1 || stat["TlsRxSw"] != int64(slow)+1 || stat["TlsDecryptError"] != 0) {
		t.Errorf("tls_stat delta %v: want TlsTxSw and TlsRxSw %d (every slow session and the normal tunnel offloaded), TlsDecryptError 0", stat, slow+1)
	}
}

// Peers that fail mutual TLS never reach the preamble parser: non-TLS
// bytes, no client certificate, a certificate of another CA, and one of
// the right CA that is not on the leaf allowlist. Each connection is
// closed without a tunnel byte, logged with the peer, counted as
// handshake-failed, and nothing is dialed.
func TestSandboxHandshakeRefusals(t *testing.T) { sandboxHandshakeRefusals(t, false) }

// TestKernelSandboxHandshakeRefusals is TestSandboxHandshakeRefusals on a
// kTLS kernel: a refused handshake installs nothing (tls_stat: no TX, no
// RX, no ULP error).
func TestKernelSandboxHandshakeRefusals(t *testing.T) {
	kerneltest.Require(t)
	sandboxHandshakeRefusals(t, true)
}

func sandboxHandshakeRefusals(t *testing.T, kernel bool) {
	up := forwardtest.NewUpstream(t, 0)
	e := newSandboxEnv(t, nil)
	forwardtest.CheckLeaks(t)
	since := dataPathDelta(t, kernel)
	outcomes0 := ktls.Stats().Outcomes
	stranger := e.ca.Client(t, "not-allowed")
	otherCA := testpki.NewCA(t, "other CA").Client(t, "gateway-1")
	tlsCase := func(leaf *testpki.Leaf) func(t *testing.T) {
		return func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			c, err := preamble.Dial(ctx, "tcp", e.addr, e.tlsConfig(leaf), e.gw.Signer, preamble.Claims{SandboxID: "sbx", Target: up.Addr()})
			if err != nil {
				return // refused in the handshake
			}
			defer c.Close()
			// TLS 1.3: the client learns of the refusal on its first read.
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if n, err := io.Copy(io.Discard, c); n != 0 || err == nil {
				t.Errorf("refused client read %d tunnel bytes and then err %v; want an error, no byte", n, err)
			}
		}
	}
	cases := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"non-tls", func(t *testing.T) {
			c, err := net.Dial("tcp", e.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if b, _ := io.ReadAll(c); len(b) > 0 && b[0] != 0x15 { // at most a TLS alert record
				t.Errorf("non-TLS client read %q", b)
			}
		}},
		{"no-client-certificate", tlsCase(nil)},
		{"other-ca", tlsCase(otherCA)},
		{"not-on-allowlist", tlsCase(stranger)},
	}
	failed := func() uint64 { return ktls.Stats().Outcomes[ktls.ReasonHandshakeFailed] }
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := failed()
			logged := len(e.logLines(t, "handling connection"))
			tc.run(t)
			deadline := time.Now().Add(5 * time.Second)
			for failed() != before+1 || len(e.logLines(t, "handling connection")) != logged+1 {
				if time.Now().After(deadline) {
					t.Fatalf("handshake-failed %d -> %d, log lines %d -> %d; want one more of each",
						before, failed(), logged, len(e.logLines(t, "handling connection")))
				}
				time.Sleep(10 * time.Millisecond)
			}
			l := e.logLines(t, "handling connection")[logged]
			if l["level"] != "error" || l["remote"] == "" || !strings.Contains(fmt.Sprint(l["error"]), "ktls handshake") {
				t.Errorf("log line %v: want an error naming the handshake and the peer", l)
			}
		})
	}
	if up.Accepted() != 0 {
		t.Errorf("upstream dialed %d times for refused peers", up.Accepted())
	}
	if n := len(e.logLines(t, "sandbox tunnel rejected")); n != 0 {
		t.Errorf("%d refused peers reached the preamble parser", n)
	}
	metrics := string(e.adminBody(t, "/metrics"))
	if line := fmt.Sprintf("caddy_ktls_handshakes_total{reason=%q} %d\n", ktls.ReasonHandshakeFailed, failed()); !strings.Contains(metrics, line) {
		t.Errorf("/metrics lacks %q", line)
	}
	// No refused peer got an offload outcome of its own.
	for r, n := range ktls.Stats().Outcomes {
		want := outcomes0[r]
		if r == ktls.ReasonHandshakeFailed {
			want += uint64(len(cases))
		}
		if n != want {
			t.Errorf("handshakes with reason %s: %d -> %d, want %d", r, outcomes0[r], n, want)
		}
	}
	stat, dp := since()
	if dp != (forward.DataPath{}) {
		t.Errorf("data path %+v for refused peers, want nothing relayed", dp)
	}
	if kernel {
		for _, k := range []string{"TlsTxSw", "TlsRxSw", "TlsTxDevice", "TlsRxDevice", "TlsDecryptError"} {
			if stat[k] != 0 {
				t.Errorf("tls_stat delta %v: want %s 0 (a refused handshake installs nothing)", stat, k)
			}
		}
	}
}

// tricklingUpstream is a sandbox service that writes chunk pattern bytes
// every pace on each connection until the connection fails, and discards
// what it receives. It stops at test cleanup.
func tricklingUpstream(t *testing.T, chunk int, pace time.Duration) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(2)
			go func() {
				defer wg.Done()
				io.Copy(io.Discard, c)
			}()
			go func() {
				defer wg.Done()
				defer c.Close()
				buf := make([]byte, chunk)
				src := forwardtest.NewPattern(1)
				for {
					src.Read(buf)
					if _, err := c.Write(buf); err != nil {
						return
					}
					time.Sleep(pace)
				}
			}()
		}
	}()
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// streamOutcome is what a pacedStream client sent and received.
type streamOutcome struct {
	sent, recv       int64
	sentSum, recvSum [32]byte
	err              error
}

// pacedStream writes chunk pattern bytes (seed) on c every pace until stop
// is closed, then half-closes; meanwhile it reads to EOF. It closes c and
// reports both directions' counts and hashes.
func pacedStream(c *tls.Conn, seed uint64, chunk int, pace time.Duration, stop <-chan struct{}) <-chan streamOutcome {
	out := make(chan streamOutcome, 1)
	go func() {
		defer c.Close()
		var o streamOutcome
		werr := make(chan error, 1)
		go func() {
			h := sha256.New()
			src := forwardtest.NewPattern(seed)
			buf := make([]byte, chunk)
			for {
				src.Read(buf)
				if _, err := c.Write(buf); err != nil {
					werr <- err
					return
				}
				h.Write(buf)
				o.sent += int64(chunk)
				select {
				case <-stop:
					copy(o.sentSum[:], h.Sum(nil))
					werr <- c.CloseWrite()
					return
				case <-time.After(pace):
				}
			}
		}()
		h := sha256.New()
		o.recv, o.err = io.Copy(h, c)
		copy(o.recvSum[:], h.Sum(nil))
		if err := <-werr; o.err == nil {
			o.err = err
		}
		out <- o
	}()
	return out
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
	before := tunnels.Rejections()[string(forward.ReasonTunnelLimit)]
	metrics0 := e.metrics(t)
	held := []*tls.Conn{e.dial(t, sandbox, up.Addr()), e.dial(t, sandbox, up.Addr())}
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

	through := func(c *tls.Conn, seed uint64) {
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
	expired := tunnels.Expired()
	metrics0 := e.metrics(t)
	c := e.dial(t, uniqueSandbox("sbx-lifetime"), target)
	defer c.Close()
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, err := io.Copy(io.Discard, c)
	if age := time.Since(start); n == 0 || age < lifetime {
		t.Errorf("the gateway read %d bytes in %v; want the trickle for the %v lifetime", n, age, lifetime)
	}
	checkGatewayEnd(t, err, kernel, false)
	l := e.waitLogLine(t, "sandbox tunnel ended with an error", 0)
	if !strings.Contains(fmt.Sprint(l["error"]), "the tunnel reached its lifetime of 500ms") || l["client_certificate"] != gatewaySubject {
		t.Errorf("log line %v, want the lifetime named as the end of %s's tunnel", l, gatewaySubject)
	}
	waitIdle(t)
	if got := tunnels.Expired() - expired; got != 1 {
		t.Errorf("%d tunnels counted as expired, want 1", got)
	}
	checkMetricDeltas(t, metrics0, e.metrics(t), map[string]int64{"caddy_ktls_sandbox_tunnels_expired_total": 1})
}

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
	revoked0 := tunnels.Revoked()
	metrics0 := e.metrics(t)
	dial := func(signer *preamble.Signer) *tls.Conn {
		t.Helper()
		return e.dialWith(t, e.tlsConfig(e.client), signer, uniqueSandbox("sbx-revoke"), target)
	}
	type reader struct {
		n   atomic.Int64
		end chan error
	}
	read := func(c *tls.Conn) *reader {
		r := &reader{end: make(chan error, 1)}
		go func() {
			buf := make([]byte, 16<<10)
			for {
				n, err := c.Read(buf)
				r.n.Add(int64(n))
				if err != nil {
					r.end <- err
					return
				}
			}
		}()
		return r
	}
	keptConn, goneConn := dial(e.gw.Signer), dial(retired.Signer)
	defer keptConn.Close()
	defer goneConn.Close()
	kept, gone := read(keptConn), read(goneConn)
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
	if n := tunnels.Revoked() - revoked0; n != 1 {
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
	before := tunnels.Rejections()[string(preamble.ReasonUnknownKey)]
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

// awaitReceiveQueueStalled waits until c's receive queue (SIOCINQ) is not
// empty and has not changed over ten polls 50 ms apart: nothing is being
// delivered to c, so its peer's sends are blocked on c's full window. It
// returns the bytes queued. The 2-minute bound is for liveness only.
func awaitReceiveQueueStalled(t testing.TB, c *net.TCPConn) int {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	last, same := -1, 0
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		queued, qerr := 0, error(nil)
		if err := rc.Control(func(fd uintptr) { queued, qerr = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }); err != nil || qerr != nil {
			t.Fatalf("SIOCINQ: %v %v", err, qerr)
		}
		if queued > 0 && queued == last {
			if same++; same == 10 {
				return queued
			}
			continue
		}
		last, same = queued, 0
	}
	t.Fatalf("the gateway's receive queue never stopped growing (last %d bytes)", last)
	return 0
}

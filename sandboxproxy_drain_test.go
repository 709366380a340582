package caddyktls

import (
	"crypto/tls"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// SIGTERM to a gateway Caddy (sandbox_proxy, then a forwarder Caddy) with
// tunnels streaming both ways: the gateway drains them for
// drain_grace_period before it exits.

// drainingGateway is a running gateway process and its forwarder, the
// sandbox answering at up.
type drainingGateway struct {
	fwd, gw *sandboxEnv
	p       *caddyProcess
	up      *forwardtest.Upstream
}

const drainChunk, drainPace = 4 << 10, 20 * time.Millisecond

func startDrainingGateway(t *testing.T, grace string) *drainingGateway {
	t.Helper()
	up := forwardtest.NewPacedUpstream(t, drainChunk, drainPace)
	fwd, gw := gatewayProcessConfig(t, up, false, map[string]any{"drain_grace_period": grace})
	return &drainingGateway{fwd: fwd, gw: gw, p: startCaddy(t, gw, ""), up: up}
}

// streams opens n users' tunnels, to sandboxes sbx-gwdrain-<from> on,
// streaming until stop is closed, and waits for bytes of each at the
// sandbox; from is how many the test opened before.
func (g *drainingGateway) streams(t *testing.T, from, n int, stop <-chan struct{}) []<-chan streamOutcome {
	t.Helper()
	var out []<-chan streamOutcome
	for i := from; i < from+n; i++ {
		c, err := tls.Dial("tcp", g.gw.addr, &tls.Config{RootCAs: g.fwd.ca.Pool, ServerName: fmt.Sprintf("sbx-gwdrain-%d.sandbox.test", i)})
		if err != nil {
			t.Fatalf("user %d: %v", i, err)
		}
		out = append(out, pacedStream(c, uint64(900+i), drainChunk, drainPace, stop))
	}
	waitUntil(t, time.Minute, func() bool { return g.up.Accepted() == from+n && g.up.Received() >= int64((from+n)*drainChunk) },
		"every tunnel's first bytes at the upstream")
	return out
}

func (g *drainingGateway) sigterm(t *testing.T) {
	t.Helper()
	if err := g.p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
}

// Tunnels that end within the grace period run on after SIGTERM, moving
// bytes both ways, to their orderly end, exact; the gateway then exits 0
// without closing any.
func TestSandboxProxyDrainAtExitFinishes(t *testing.T) {
	const n = 2
	g := startDrainingGateway(t, "2m")
	stop := make(chan struct{})
	streams := g.streams(t, 0, n, stop)
	g.sigterm(t)
	started := g.gw.waitLogLine(t, drainStartLine, 0)
	if started["level"] != "info" || started["tunnels"] != float64(n) || started["grace_period"] == nil {
		t.Errorf("drain start log line %v, want one at INFO with %d tunnels and the grace period", started, n)
	}
	at := g.up.Received()
	waitUntil(t, time.Minute, func() bool { return g.up.Received() >= at+int64(4*n*drainChunk) }, "bytes through the tunnels while the gateway drains")
	select {
	case <-g.p.exited:
		t.Fatal("the gateway exited with its tunnels open, within the grace period")
	default:
	}
	close(stop)
	var outcomes []streamOutcome
	for _, s := range streams {
		outcomes = append(outcomes, <-s)
	}
	select {
	case <-g.p.exited:
		if g.p.exitErr != nil {
			t.Errorf("the gateway exited with %v", g.p.exitErr)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the gateway did not exit once its tunnels ended")
	}
	g.up.Close()
	for i, o := range outcomes {
		if o.err != nil || !exactAtUpstream(o, g.up.Results()) || o.recv == 0 {
			t.Errorf("tunnel %d (sent %d, received %d, %v): not carried exact both ways through the drain", i, o.sent, o.recv, o.err)
		}
	}
	if lines := g.gw.logLines(t, "closed tunnels still open after the drain grace period"); len(lines) != 0 {
		t.Errorf("the gateway closed tunnels at its drain's deadline: %v", lines)
	}
}

// A tunnel still open when the grace period ends is closed as a failure
// (its user sees an error, not an orderly end), the log says how many, and
// the gateway exits 0.
func TestSandboxProxyDrainAtExitClosesAtDeadline(t *testing.T) {
	g := startDrainingGateway(t, "500ms")
	stop := make(chan struct{})
	defer close(stop)
	streams := g.streams(t, 0, 1, stop)
	g.sigterm(t)
	g.p.exitedAfterDrain(t, g.gw, 1)
	select {
	case o := <-streams[0]:
		if o.err == nil {
			t.Errorf("the user's stream ended in order after %d bytes received: a tunnel cut at the deadline must not look complete", o.recv)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the user's stream did not end after the gateway exited")
	}
	ended := g.gw.logLines(t, "sandbox_proxy: tunnel closed at exit: it was still open when the drain grace period ended")
	if len(ended) != 1 || ended[0]["end"] != "drained" || ended[0]["sandbox"] != "sbx-gwdrain-0" {
		t.Errorf("tunnel end log lines %v, want one, end drained, for sbx-gwdrain-0", ended)
	}
}

// A reload leaves the tunnels of the handler it replaced running, and the
// drain at exit covers that retired handler too: its tunnel and the new
// handler's are closed at the end of one grace period, counted in one log
// line.
func TestSandboxProxyDrainAtExitCoversReloadedHandlers(t *testing.T) {
	g := startDrainingGateway(t, "1s")
	stop := make(chan struct{})
	defer close(stop)
	streams := g.streams(t, 0, 1, stop)
	layer4Server(g.gw.cfg, "tunnels")["routes"].([]any)[0].(map[string]any)["handle"].([]any)[1].(map[string]any)["dial_timeout"] = "11s"
	g.gw.postLoad(t)
	if lines := g.gw.logLines(t, drainStartLine); len(lines) != 0 {
		t.Fatalf("the reload drained: %v", lines)
	}
	streams = append(streams, g.streams(t, 1, 1, stop)...)
	g.sigterm(t)
	g.p.exitedAfterDrain(t, g.gw, 2)
	if started := g.gw.logLines(t, drainStartLine); len(started) != 1 || started[0]["handlers"] != 2.0 || started[0]["tunnels"] != 2.0 {
		t.Errorf("drain start log lines %v, want one for 2 tunnels in 2 handlers (the retired one's and the new one's)", started)
	}
	for i, s := range streams {
		select {
		case o := <-s:
			if o.err == nil {
				t.Errorf("tunnel %d ended in order after %d bytes received: want it cut at the drain's deadline", i, o.recv)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("tunnel %d did not end after the gateway exited", i)
		}
	}
}

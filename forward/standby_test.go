package forward

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// A verified client's standby connection waits for its first preamble
// byte up to StandbyTimeout, well past PreambleTimeout, and then carries
// its tunnel exactly; beyond MaxStandbyPerClient waiting at once, a
// connection has PreambleTimeout as before. A standby connection that
// ends without a preamble (closed by the client, or past StandbyTimeout)
// is counted as such and is no refusal.
func TestStandbyWaitsForPreamble(t *testing.T) {
	forwardtest.CheckLeaks(t)
	const size = 64 << 10
	up := forwardtest.NewUpstream(t, size)
	f := newFixture(t, func(c *Config) {
		c.PreambleTimeout, c.StandbyTimeout, c.MaxStandbyPerClient = 100*time.Millisecond, 10*time.Second, 2
	})
	f.verified.Store(true)
	waiting := func(want int) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if n, _ := f.reg.Standby(); n == want {
				return
			} else if time.Now().After(deadline) {
				t.Fatalf("%d standby connections waiting, want %d", n, want)
			}
		}
	}
	// Two standby connections wait: the client's bound.
	a, b := f.dial(t), f.dial(t)
	waiting(2)
	// Both are Serve calls that have opened no tunnel yet.
	if n := f.reg.Opening(); n != 2 {
		t.Errorf("Opening() = %d with two standby connections waiting, want 2", n)
	}
	// A third waits under PreambleTimeout: refused as a timeout.
	f.refused(t, 1, "timeout", func(*net.TCPConn) {})
	// Five preamble timeouts later, the first standby connection carries
	// its tunnel, every byte.
	time.Sleep(5 * f.fwd.cfg.PreambleTimeout)
	if _, recv, n := runTunnel(t, a, f.gw.Frame(t, "sbx-standby", up.Addr()), size, 3); n != size || recv != forwardtest.PatternSum(2, size) {
		t.Errorf("the standby connection's tunnel received %d bytes (want %d) or another hash", n, size)
	}
	if errs := f.wait(t, 2); errs[1] != nil {
		t.Errorf("the standby connection's tunnel: %v", errs[1])
	}
	// The client closes the second unused.
	b.Close()
	errs := f.wait(t, 3)
	if se, ok := errors.AsType[*StandbyEndError](errs[2]); !ok || se.End != StandbyClosed {
		t.Errorf("a standby connection closed unused: %v, want a StandbyEndError %q", errs[2], StandbyClosed)
	}
	if n, ends := f.reg.Standby(); n != 0 || ends[StandbyClosed] != 1 || ends[StandbyExpired] != 0 {
		t.Errorf("standby: %d waiting, ends %v; want none waiting and one closed", n, ends)
	}
	if n := f.reg.Opening(); n != 0 {
		t.Errorf("Opening() = %d once every connection opened its tunnel or ended, want 0", n)
	}
	if rej := f.reg.RefusedTunnels(); rej["timeout"] != 1 || len(rej) != 1 {
		t.Errorf("rejections %v, want the one timeout", rej)
	}
}

// A standby connection that sends nothing for StandbyTimeout is ended
// (refused: the client learns it is gone), counted as expired, and is no
// refusal.
func TestStandbyExpires(t *testing.T) {
	forwardtest.CheckLeaks(t)
	f := newFixture(t, func(c *Config) { c.StandbyTimeout = 200 * time.Millisecond })
	f.verified.Store(true)
	c := f.dial(t)
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := io.Copy(io.Discard, c); n != 0 {
		t.Errorf("an expired standby connection read %d bytes (%v), want none", n, err)
	}
	err := f.wait(t, 1)[0]
	if se, ok := errors.AsType[*StandbyEndError](err); !ok || se.End != StandbyExpired {
		t.Errorf("an unused standby connection: %v, want a StandbyEndError %q", err, StandbyExpired)
	}
	if _, ends := f.reg.Standby(); ends[StandbyExpired] != 1 {
		t.Errorf("standby ends %v, want one expired", ends)
	}
	if rej := f.reg.RefusedTunnels(); len(rej) != 0 {
		t.Errorf("rejections %v, want none", rej)
	}
}

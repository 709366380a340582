package forward

import (
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// MaxDials bounds the tunnels dialing their target at once, a wake
// included: while one tunnel waits for its sandbox to wake, a second is
// refused as overloaded before it dials anything; the first, admitted,
// runs to its end with every byte, and once it has dialed a third is
// admitted again.
func TestMaxDialsRefusesOverloaded(t *testing.T) {
	forwardtest.CheckLeaks(t)
	plane, waker := newWakePlane(t, http.StatusAccepted, 0)
	f := newFixture(t, func(c *Config) { c.MaxDials, c.Wake, c.WakeTimeout = 1, waker, 10*time.Second })
	asleep := forwardtest.ClosedPort(t)
	const size = 64 << 10
	type result struct {
		recv [32]byte
		n    int64
	}
	first := make(chan result, 1)
	go func() {
		_, recv, n := runTunnel(t, f.dial(t), f.gw.Frame(t, "sbx-asleep", asleep), size, 1)
		first <- result{recv, n}
	}()
	// The wake request is in: the first tunnel holds the one dial.
	<-plane.woken
	if n := f.reg.Dialing(); n != 1 {
		t.Fatalf("%d dials in progress, want the waking tunnel's 1", n)
	}
	awake := forwardtest.NewUpstream(t, size)
	f.refused(t, 1, string(ReasonOverloaded), func(c *net.TCPConn) { c.Write(f.gw.Frame(t, "sbx-awake", awake.Addr())) })
	if n := awake.Accepted(); n != 0 {
		t.Errorf("the refused tunnel's target was dialed %d times, want 0", n)
	}

	// The sandbox wakes: the admitted tunnel runs to its end, exact.
	up := forwardtest.NewUpstreamOn(t, asleep.String(), size)
	if r := <-first; r.n != size || r.recv != forwardtest.PatternSum(2, size) {
		t.Errorf("the admitted tunnel's gateway received %d bytes (want %d) or another hash", r.n, size)
	}
	if errs := f.wait(t, 2); errs[1] != nil {
		t.Errorf("the admitted tunnel: %v", errs[1])
	}
	up.Close()
	if rs := up.Results(); len(rs) != 1 || rs[0].Received != size || rs[0].RecvSum != forwardtest.PatternSum(1, size) {
		t.Errorf("the woken target received %+v, want one tunnel's %d bytes exact", rs, size)
	}

	// The dial is free again.
	if _, recv, n := runTunnel(t, f.dial(t), f.gw.Frame(t, "sbx-awake", awake.Addr()), size, 3); n != size || recv != forwardtest.PatternSum(2, size) {
		t.Errorf("a tunnel after the wake received %d bytes (want %d) or another hash", n, size)
	}
	if errs := f.wait(t, 3); errs[2] != nil {
		t.Errorf("the tunnel after the wake: %v", errs[2])
	}
	if rej := f.reg.RefusedTunnels(); rej[string(ReasonOverloaded)] != 1 || len(rej) != 1 {
		t.Errorf("rejections %v, want one overloaded", rej)
	}
	if n := f.reg.Dialing(); n != 0 {
		t.Errorf("%d dials in progress after every tunnel ended, want 0", n)
	}
}

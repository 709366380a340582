package gateway

import (
	"context"
	"crypto/sha256"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// standbyLog records what Config.OnStandby is told.
type standbyLog struct {
	mu  sync.Mutex
	got []string
}

func (l *standbyLog) on(outcome string) { l.mu.Lock(); l.got = append(l.got, outcome); l.mu.Unlock() }

func (l *standbyLog) count(outcome string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, o := range l.got {
		if o == outcome {
			n++
		}
	}
	return n
}

// waitFor polls cond until it holds, or fails t naming what it waited for.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func (d *Dialer) standbyReady(forwarder string) int {
	d.standby.mu.Lock()
	defer d.standby.mu.Unlock()
	return len(d.standby.ready[forwarder])
}

// standbyTunnelSize is what each tunnel of the standby tests carries.
const standbyTunnelSize = 64 << 10

// standbyForwarder checks t for leaks and starts a forwarder whose standby
// connections wait standbyTimeout, and an upstream behind it.
func standbyForwarder(t *testing.T, standbyTimeout time.Duration) (pki, *forwardtest.Gateway, *forwardtest.Upstream, *forwarder) {
	forwardtest.CheckLeaks(t)
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	up := forwardtest.NewUpstream(t, standbyTunnelSize)
	f := startForwarderWith(t, p, gw, "127.0.0.0/8", func(c *forward.Config) { c.StandbyTimeout = standbyTimeout })
	return p, gw, up, f
}

// exactDial opens a tunnel of route with d and carries size bytes each way
// through it, checking what came back (the upstream's tests check what
// went).
func exactDial(t *testing.T, d *Dialer, route Route, size int64, seed uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := d.Dial(ctx, route)
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer c.Close()
	errc := make(chan error, 1)
	go func() {
		_, err := forwardtest.SendPattern(c, size, seed)
		errc <- err
	}()
	h := sha256.New()
	n, err := io.Copy(h, c)
	if werr := <-errc; err != nil || werr != nil {
		t.Fatalf("tunnel: read %v, write %v", err, werr)
	}
	if n != size || [32]byte(h.Sum(nil)) != forwardtest.PatternSum(2, size) {
		t.Errorf("received %d bytes (want %d) or another hash", n, size)
	}
}

// With Standby, Dial keeps standby connections to each forwarder it
// dialed, mutual TLS done: the next tunnel goes on one (its preamble is
// the first thing written) and carries every byte, and the set is refilled.
// Close closes the ones left: the forwarder counts them as closed unused,
// never as refused tunnels.
func TestStandbyCarriesTunnels(t *testing.T) {
	p, gw, up, f := standbyForwarder(t, time.Minute)
	var log standbyLog
	d, err := New(Config{TLS: p.client, Signer: gw.Signer, Standby: 2, OnStandby: log.on})
	if err != nil {
		t.Fatal(err)
	}
	route := Route{Forwarder: f.addr(), Sandbox: "sbx-standby", Target: up.Addr()}

	exactDial(t, d, route, standbyTunnelSize, 1) // no standby yet: a connection of its own
	if n := log.count(StandbyUsed); n != 0 {
		t.Fatalf("%d standby connections used before any was ready", n)
	}
	waitFor(t, "2 standby connections", func() bool { return d.standbyReady(f.addr()) == 2 })
	exactDial(t, d, route, standbyTunnelSize, 2)
	if n := log.count(StandbyUsed); n != 1 {
		t.Errorf("%d standby connections used, want 1", n)
	}
	waitFor(t, "the standby connections refilled", func() bool { return d.standbyReady(f.addr()) == 2 })
	up.Close()
	rs := up.Results()
	for seed := range uint64(2) {
		if !slices.ContainsFunc(rs, func(r forwardtest.Result) bool {
			return r.Received == standbyTunnelSize && r.RecvSum == forwardtest.PatternSum(seed+1, standbyTunnelSize)
		}) || len(rs) != 2 {
			t.Errorf("the upstream received %+v, want tunnel %d's %d bytes exact, of 2", rs, seed+1, standbyTunnelSize)
		}
	}

	d.Close()
	waitFor(t, "the forwarder to count 2 standby connections closed", func() bool {
		_, ends := f.reg.Standby()
		return ends[forward.StandbyClosed] == 2
	})
	if n, ends := f.reg.Standby(); n != 0 || ends[forward.StandbyExpired] != 0 {
		t.Errorf("forwarder standby: %d waiting, ends %v; want none waiting, none expired", n, ends)
	}
	if rej := f.reg.RefusedTunnels(); len(rej) != 0 {
		t.Errorf("forwarder rejections %v, want none", rej)
	}
	if d.standbyReady(f.addr()) != 0 {
		t.Error("standby connections left after Close")
	}
}

// A standby connection the forwarder ended (its standby_timeout passed
// first) is found gone when a tunnel wants it: counted as lost, and the
// tunnel dials a connection of its own and carries every byte. One kept
// StandbyMaxIdle unused is closed by the gateway (expired).
func TestStandbyLostAndExpired(t *testing.T) {
	p, gw, up, f := standbyForwarder(t, 200*time.Millisecond)
	var log standbyLog
	d, err := New(Config{TLS: p.client, Signer: gw.Signer, Standby: 1, StandbyMaxIdle: time.Hour, OnStandby: log.on})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	route := Route{Forwarder: f.addr(), Sandbox: "sbx-lost", Target: up.Addr()}
	exactDial(t, d, route, standbyTunnelSize, 1)
	waitFor(t, "the forwarder to expire the standby connection", func() bool {
		_, ends := f.reg.Standby()
		return ends[forward.StandbyExpired] == 1
	})
	// The forwarder counts the expiry before its alert and FIN are sent:
	// the tunnel must come after they reached the gateway's socket, or it
	// may take the connection while it is still established.
	waitFor(t, "the forwarder's end of the standby connection to reach the gateway", func() bool {
		d.standby.mu.Lock()
		defer d.standby.mu.Unlock()
		ready := d.standby.ready[f.addr()]
		return len(ready) == 1 && !established(ready[0].conn)
	})
	exactDial(t, d, route, standbyTunnelSize, 2)
	if used, lost := log.count(StandbyUsed), log.count(StandbyLost); used != 0 || lost != 1 {
		t.Errorf("standby used %d, lost %d; want 0 and 1", used, lost)
	}

	short, err := New(Config{TLS: p.client, Signer: gw.Signer, Standby: 1, StandbyMaxIdle: 100 * time.Millisecond, OnStandby: log.on})
	if err != nil {
		t.Fatal(err)
	}
	defer short.Close()
	exactDial(t, short, route, standbyTunnelSize, 3)
	waitFor(t, "the gateway to expire its standby connection", func() bool { return log.count(StandbyExpired) == 1 })
	if short.standbyReady(f.addr()) != 0 {
		t.Error("an expired standby connection is still ready")
	}
	// Nothing is kept for a forwarder with no standby connection left.
	short.standby.mu.Lock()
	ready, filling := len(short.standby.ready), len(short.standby.filling)
	short.standby.mu.Unlock()
	if ready != 0 || filling != 0 {
		t.Errorf("%d ready and %d filling entries kept after the last standby connection expired, want none", ready, filling)
	}
	if rej := f.reg.RefusedTunnels(); len(rej) != 0 {
		t.Errorf("forwarder rejections %v, want none", rej)
	}
}

// heldUpstream accepts connections and, on each, reads everything and
// sends size bytes of pattern 2, then half-closes, only once release is
// closed. got receives a value for each connection once it read want
// bytes.
type heldUpstream struct {
	ln      net.Listener
	release chan struct{}
	got     chan struct{} // one per connection that read want bytes
	wg      sync.WaitGroup
}

func newHeldUpstream(t *testing.T, want, size int64) *heldUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &heldUpstream{ln: ln, release: make(chan struct{}), got: make(chan struct{}, 16)}
	u.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u.wg.Go(func() {
				defer c.Close()
				if n, _ := io.CopyN(io.Discard, c, want); n == want {
					u.got <- struct{}{}
				}
				<-u.release
				forwardtest.SendPattern(c.(*net.TCPConn), size, 2)
				io.Copy(io.Discard, c)
			})
		}
	})
	t.Cleanup(func() {
		select {
		case <-u.release:
		default:
			close(u.release)
		}
		ln.Close()
		u.wg.Wait()
	})
	return u
}

func (u *heldUpstream) addr() netip.AddrPort { return u.ln.Addr().(*net.TCPAddr).AddrPort() }

// standbyState is d's standby set for forwarder: ready connections, and
// whether a refill runs.
func (d *Dialer) standbyState(forwarder string) (ready int, filling bool) {
	d.standby.mu.Lock()
	defer d.standby.mu.Unlock()
	return len(d.standby.ready[forwarder]), d.standby.filling[forwarder]
}

// Carry starts its forwarder's standby refill at the tunnel's first byte
// back, not while the tunnel opens: a tunnel whose sandbox has read the
// user's bytes and not answered yet has started no refill; its answer
// starts it, and every byte arrives exact.
func TestCarryRefillsStandbyAtFirstByte(t *testing.T) {
	const size = 8 << 10
	p, gw, _, f := standbyForwarder(t, time.Minute)
	up := newHeldUpstream(t, size, size)
	d, err := New(Config{TLS: p.client, Signer: gw.Signer, Standby: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	fr := startFront(t, p, d, Route{Forwarder: f.addr(), Sandbox: "sbx-refill", Target: up.addr()})
	type user struct {
		recv [32]byte
		n    int64
		err  error
	}
	done := make(chan user, 1)
	go func() {
		var u user
		_, u.recv, u.n, u.err = userTunnel(t, fr.ln.Addr().String(), p.client, size, 1)
		done <- u
	}()
	<-up.got // the sandbox has every byte the user sent, and has not answered
	if ready, filling := d.standbyState(f.addr()); ready != 0 || filling {
		t.Errorf("before the tunnel's first byte back: %d standby connections ready, refilling %v; want none started", ready, filling)
	}
	close(up.release)
	u := <-done
	if u.err != nil || u.n != size || u.recv != forwardtest.PatternSum(2, size) {
		t.Errorf("user received %d bytes (want %d), read error %v, or another hash", u.n, size, u.err)
	}
	if r := fr.result(t); r.err != nil {
		t.Errorf("relay: %v", r.err)
	}
	waitFor(t, "2 standby connections after the first byte", func() bool { return d.standbyReady(f.addr()) == 2 })
}

// A sandbox that stays silent defers the refill standbyRefillWait at most.
func TestCarryRefillsStandbyAfterWait(t *testing.T) {
	const size = 8 << 10
	defer func(w time.Duration) { standbyRefillWait = w }(standbyRefillWait)
	standbyRefillWait = 50 * time.Millisecond
	p, gw, _, f := standbyForwarder(t, time.Minute)
	up := newHeldUpstream(t, size, size)
	d, err := New(Config{TLS: p.client, Signer: gw.Signer, Standby: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	fr := startFront(t, p, d, Route{Forwarder: f.addr(), Sandbox: "sbx-refill", Target: up.addr()})
	done := make(chan int64, 1)
	go func() {
		_, _, n, _ := userTunnel(t, fr.ln.Addr().String(), p.client, size, 1)
		done <- n
	}()
	<-up.got
	waitFor(t, "2 standby connections while the sandbox is silent", func() bool { return d.standbyReady(f.addr()) == 2 })
	close(up.release)
	if n := <-done; n != size {
		t.Errorf("user received %d bytes, want %d", n, size)
	}
	fr.result(t)
}

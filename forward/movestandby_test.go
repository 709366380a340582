package forward

import (
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
)

// standbySession connects a sender and a receiver; the receiver adopts
// every standby connection into f, one at a time (Item.Adopt), unless
// refuse says no to its offer (counted from 1), and passes it to adopted
// unserved. offered counts the objects offered.
func standbySession(t *testing.T, f *Forwarder, refuse func(offer int64) bool, adopted chan<- *AdoptedStandby, offered *atomic.Int64) *handoff.Sender {
	t.Helper()
	return serialSession(t, func(it *handoff.Item) {
		offer := offered.Add(1)
		if it.Kind != handoff.KindStandby {
			it.Refuse("not a standby connection")
			t.Errorf("object kind %d offered, want handoff.KindStandby", it.Kind)
			return
		}
		ms, err := DecodeMovedStandby(it.State)
		if err != nil || ms.Forwarder != testMoveName {
			t.Errorf("moved standby state: forwarder %q, %v; want its forwarder's MoveName %q", ms.Forwarder, err, testMoveName)
		}
		if refuse(offer) {
			it.Refuse("the test refuses every standby connection")
			return
		}
		a, err := f.AdoptStandby(ms, it.Files)
		it.Close() // the adopted connection holds a duplicate
		if err != nil {
			t.Errorf("AdoptStandby: %v", err)
			it.Refuse(err.Error())
			return
		}
		if err := it.Adopt(); err != nil {
			a.Discard()
			return
		}
		adopted <- a
	})
}

func never(int64) bool  { return false }
func always(int64) bool { return true }

// served is the end of one AdoptedStandby.Serve.
type served struct {
	res Result
	err error
}

func serveAdopted(a *AdoptedStandby, wg *sync.WaitGroup) <-chan served {
	out := make(chan served, 1)
	wg.Go(func() {
		res, err := a.Serve(nil)
		out <- served{res, err}
	})
	return out
}

// testMoveName is the MoveName of the forwarders whose standby
// connections the tests move; the moved state carries it.
const testMoveName = "forwarder-of-the-test"

func standbyConfig(c *Config) {
	c.StandbyTimeout, c.HandOffConn, c.AdoptConn, c.MoveName = 10*time.Second, tcpHandOff, tcpAdopt, testMoveName
}

func waitStandby(t *testing.T, reg *Registry, want int) {
	t.Helper()
	waitUntil(t, "standby connections waiting", func() bool { n, _ := reg.Standby(); return n == want })
}

// checkTunnel checks a tunnel run with runTunnel (send bytes of seed's
// pattern, the upstream's reply read back) against the upstream's only
// connection.
func checkTunnel(t *testing.T, up *forwardtest.Upstream, send, reply int64, sent, recv [32]byte, recvN int64) {
	t.Helper()
	up.Close()
	rs := up.Results()
	if len(rs) != 1 {
		t.Fatalf("the upstream served %d connections, want 1", len(rs))
	}
	r := rs[0]
	if r.Received != send || r.RecvSum != sent {
		t.Errorf("upstream got %d bytes (sha %x), the gateway sent %d (sha %x)", r.Received, r.RecvSum, send, sent)
	}
	if recvN != reply || r.Sent != reply || recv != r.SentSum || recv != forwardtest.PatternSum(2, reply) {
		t.Errorf("the gateway got %d bytes (sha %x), the upstream sent %d (sha %x), want %d", recvN, recv, r.Sent, r.SentSum, reply)
	}
}

// A standby connection moves to another forwarder; the gateway then
// writes its preamble on the same connection, and the new forwarder
// carries the tunnel, every byte both ways. The old Serve ends as a
// standby connection moved; the new process counts it as its own standby
// connection until the preamble.
func TestMoveStandby(t *testing.T) {
	forwardtest.CheckLeaks(t)
	const send, reply = 256 << 10, 192 << 10
	old := newFixture(t, standbyConfig)
	old.verified.Store(true)
	up := forwardtest.NewUpstream(t, reply)
	nu, nuReg := newProcess(t, old.gw, func(c *Config) { c.StandbyTimeout = 10 * time.Second })
	c := old.dial(t)
	waitStandby(t, old.reg, 1)

	adopted := make(chan *AdoptedStandby, 1)
	var offered atomic.Int64
	s := standbySession(t, nu, never, adopted, &offered)
	res := old.reg.MoveStandby(context.Background(), handoff.SenderMover(s))
	s.Close()
	if res.Moved != 1 || len(res.Stays) != 0 || offered.Load() != 1 {
		t.Fatalf("moved %d, stays %v, offered %d; want the one moved", res.Moved, res.Stays, offered.Load())
	}
	err := old.wait(t, 1)[0]
	if se, ok := errors.AsType[*StandbyEndError](err); !ok || se.End != StandbyMoved {
		t.Errorf("old Serve: %v, want a StandbyEndError %q", err, StandbyMoved)
	}
	if n, ends := old.reg.Standby(); n != 0 || len(ends) != 1 || ends[StandbyMoved] != 1 {
		t.Errorf("old registry: %d standby waiting, ends %v; want none waiting and one moved", n, ends)
	}
	if rej := old.reg.RefusedTunnels(); len(rej) != 0 {
		t.Errorf("old registry refused %v, want nothing", rej)
	}

	a := <-adopted
	if g := a.Gateway(); !g.CertificateVerified || g.Peer != c.LocalAddr().String() || g.StandbyBegan.IsZero() {
		t.Errorf("adopted gateway %+v: want the verified peer %s and its standby start", g, c.LocalAddr())
	}
	var serves sync.WaitGroup
	out := serveAdopted(a, &serves)
	waitStandby(t, nuReg, 1)
	sent, recv, n := runTunnel(t, c, old.gw.Frame(t, "sbx-standby", up.Addr()), send, 7)
	got := <-out
	serves.Wait()
	if got.err != nil || got.res.Tunnel.ID == 0 || got.res.Tunnel.BytesToSandbox != send || got.res.Tunnel.BytesFromSandbox != reply {
		t.Errorf("new Serve: %+v, %v; want a tunnel of %d bytes to and %d from the sandbox", got.res.Tunnel, got.err, send, reply)
	}
	checkTunnel(t, up, send, reply, sent, recv, n)
	if _, opened := nuReg.Counts(); opened != 1 {
		t.Errorf("the new registry opened %d tunnels, want 1", opened)
	}
	if _, opened := old.reg.Counts(); opened != 0 {
		t.Errorf("the old registry opened %d tunnels, want 0", opened)
	}
	if n, ends := nuReg.Standby(); n != 0 || len(ends) != 0 {
		t.Errorf("new registry: %d standby waiting, ends %v; want none: its standby connection opened a tunnel", n, ends)
	}
}

// A standby connection the other process refuses, one whose forwarder
// cannot hand connections off, and one offered after ctx ended wait on
// here as if nothing had happened, and a later preamble opens the tunnel
// here, exact.
func TestMoveStandbyStays(t *testing.T) {
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		ctx  context.Context
		why  string
	}{
		{"refused", standbyConfig, context.Background(), handoff.StayRefused},
		{"not-movable", func(c *Config) { c.StandbyTimeout = 10 * time.Second }, context.Background(), handoff.StayNotMovable},
		{"ctx-ended", standbyConfig, canceled, handoff.StayPause},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forwardtest.CheckLeaks(t)
			const send, reply = 128 << 10, 96 << 10
			old := newFixture(t, tc.mod)
			old.verified.Store(true)
			up := forwardtest.NewUpstream(t, reply)
			nu, nuReg := newProcess(t, old.gw, func(c *Config) { c.StandbyTimeout = 10 * time.Second })
			c := old.dial(t)
			waitStandby(t, old.reg, 1)
			adopted := make(chan *AdoptedStandby, 1)
			var offered atomic.Int64
			s := standbySession(t, nu, always, adopted, &offered)
			res := old.reg.MoveStandby(tc.ctx, handoff.SenderMover(s))
			s.Close()
			if res.Moved != 0 || len(res.Stays) != 1 || res.Stayed[tc.why] != 1 || res.Stays[0].Object != c.LocalAddr().String() {
				t.Fatalf("moved %d, stays %v; want the one to stay: %s", res.Moved, res.Stays, tc.why)
			}
			if want := int64(map[bool]int{true: 1}[tc.why == handoff.StayRefused]); offered.Load() != want {
				t.Errorf("offered %d, want %d", offered.Load(), want)
			}
			// Still one of the old registry's standby connections.
			waitStandby(t, old.reg, 1)
			sent, recv, n := runTunnel(t, c, old.gw.Frame(t, "sbx-stay", up.Addr()), send, 9)
			if errs := old.wait(t, 1); errs[0] != nil {
				t.Errorf("old Serve: %v", errs[0])
			}
			checkTunnel(t, up, send, reply, sent, recv, n)
			if res := old.res[0]; res.Tunnel.BytesToSandbox != send || res.Tunnel.BytesFromSandbox != reply {
				t.Errorf("old tunnel %+v, want %d bytes to and %d from the sandbox", res.Tunnel, send, reply)
			}
			if n, ends := old.reg.Standby(); n != 0 || len(ends) != 0 {
				t.Errorf("old registry: %d standby waiting, ends %v; want none", n, ends)
			}
			if _, opened := nuReg.Counts(); opened != 0 {
				t.Errorf("the new registry opened %d tunnels, want none", opened)
			}
		})
	}
}

// hookConn is a gateway connection whose wait the test can interleave
// with MoveStandby: onInterrupt runs when a read deadline in the past is
// set (MoveStandby's interruption, under the wait's lock), before it
// applies; reads tells of each Read's end.
type hookConn struct {
	*net.TCPConn
	onInterrupt func()
	reads       chan readEnd
	// hold, when set, holds each Read's return until it is closed.
	hold atomic.Pointer[chan struct{}]
}

type readEnd struct {
	n   int
	err error
}

func (h *hookConn) SetReadDeadline(t time.Time) error {
	if f := h.onInterrupt; f != nil && !t.IsZero() && t.Before(time.Now()) {
		h.onInterrupt = nil
		f()
	}
	return h.TCPConn.SetReadDeadline(t)
}

func (h *hookConn) Read(p []byte) (int, error) {
	n, err := h.TCPConn.Read(p)
	if hold := h.hold.Load(); hold != nil {
		<-*hold
	}
	select {
	case h.reads <- readEnd{n, err}:
	default:
	}
	return n, err
}

// serveOne dials a connection that f serves as a verified gateway's,
// through a hookConn whose reads it returns, and returns the client's end
// and how Serve ended.
func serveOne(t *testing.T, f *Forwarder, wg *sync.WaitGroup) (c *net.TCPConn, reads chan readEnd, out <-chan served) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	cc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	reads = make(chan readEnd, 1)
	ch := make(chan served, 1)
	wg.Go(func() {
		c, err := ln.Accept()
		if err != nil {
			t.Error(err)
			ch <- served{err: err}
			return
		}
		h := &hookConn{TCPConn: c.(*net.TCPConn), reads: reads}
		res, err := f.Serve(Gateway{Conn: h, Peer: c.RemoteAddr().String(), CertificateVerified: true,
			Unwrap: func() (net.Conn, []byte) { return h.TCPConn, nil }})
		ch <- served{res, err}
	})
	return cc.(*net.TCPConn), reads, ch
}

// The races of a move with the gateway: the first preamble byte arrives
// as the wait is interrupted (its Read returned it before the wait saw
// the interruption), or while the connection is on its way (the byte
// moves with the socket), or the gateway closes the connection as the
// wait is interrupted. Each byte is served exactly once, by the process
// that holds the connection, and MoveStandby neither blocks on nor counts
// a connection that is no standby connection any more.
func TestMoveStandbyRaces(t *testing.T) {
	const send, reply = 64 << 10, 48 << 10
	for _, tc := range []string{"byte-first", "byte-in-flight", "closed"} {
		t.Run(tc, func(t *testing.T) {
			forwardtest.CheckLeaks(t)
			old := newFixture(t, standbyConfig) // its forwarder, its listener unused
			up := forwardtest.NewUpstream(t, reply)
			nu, nuReg := newProcess(t, old.gw, func(c *Config) { c.StandbyTimeout = 10 * time.Second })
			var wg sync.WaitGroup
			defer wg.Wait()
			c, reads, out := serveOne(t, old.fwd, &wg)
			frame := old.gw.Frame(t, "sbx-race", up.Addr())
			waitStandby(t, old.reg, 1)
			// The hook is set under the lock of the registry's one wait.
			w := old.reg.waitingStandby()[0]
			w.mu.Lock()
			h := w.c.Conn.(*hookConn)
			var mover handoff.Mover
			adopted := make(chan *AdoptedStandby, 1)
			var offered atomic.Int64
			s := standbySession(t, nu, never, adopted, &offered)
			mover = handoff.SenderMover(s)
			switch tc {
			case "byte-first":
				// The preamble reaches the wait's Read before the
				// interruption applies: the Read returns its first byte.
				h.onInterrupt = func() {
					if _, err := c.Write(frame); err != nil {
						t.Error(err)
					}
					if r := <-reads; r.n != 1 {
						t.Errorf("the wait's read returned %d bytes (%v), want the first byte", r.n, r.err)
					}
				}
			case "closed":
				h.onInterrupt = func() {
					c.Close()
					if r := <-reads; r.n != 0 || r.err == nil {
						t.Errorf("the wait's read returned %d bytes (%v), want the end", r.n, r.err)
					}
				}
			case "byte-in-flight":
				// Written once the connection was handed off: the byte
				// waits in the socket's queue, which moves with it.
				mover = moverFunc(func(kind uint16, state []byte, files ...syscall.Conn) (bool, error) {
					if _, err := c.Write(frame); err != nil {
						t.Error(err)
					}
					return handoff.SenderMover(s).Move(kind, state, files...)
				})
			}
			w.mu.Unlock()
			res := old.reg.MoveStandby(context.Background(), mover)
			s.Close()
			var newOut <-chan served
			switch tc {
			case "byte-first", "closed":
				if res.Moved != 0 || len(res.Stays) != 0 || offered.Load() != 0 {
					t.Fatalf("moved %d, stays %v, offered %d; want nothing: no standby connection any more", res.Moved, res.Stays, offered.Load())
				}
			case "byte-in-flight":
				if res.Moved != 1 || len(res.Stays) != 0 || offered.Load() != 1 {
					t.Fatalf("moved %d, stays %v, offered %d; want the one moved", res.Moved, res.Stays, offered.Load())
				}
				newOut = serveAdopted(<-adopted, &wg)
			}
			if tc == "closed" {
				got := <-out
				if se, ok := errors.AsType[*StandbyEndError](got.err); !ok || se.End != StandbyClosed {
					t.Errorf("old Serve: %v, want a StandbyEndError %q", got.err, StandbyClosed)
				}
				if _, ends := old.reg.Standby(); len(ends) != 1 || ends[StandbyClosed] != 1 {
					t.Errorf("old registry's standby ends %v, want one closed", ends)
				}
				return
			}
			// The rest of the tunnel, the frame already written.
			errc := make(chan error, 1)
			var sent [32]byte
			go func() {
				var err error
				sent, err = forwardtest.SendPattern(c, send, 5)
				errc <- err
			}()
			recv, n := readAll(t, c)
			if err := <-errc; err != nil {
				t.Errorf("gateway write: %v", err)
			}
			c.Close()
			oldEnd := <-out
			servedBy, other := old.reg, nuReg
			tunnel := oldEnd
			if tc == "byte-in-flight" {
				if se, ok := errors.AsType[*StandbyEndError](oldEnd.err); !ok || se.End != StandbyMoved {
					t.Errorf("old Serve: %v, want a StandbyEndError %q", oldEnd.err, StandbyMoved)
				}
				tunnel = <-newOut
				servedBy, other = nuReg, old.reg
			}
			if tunnel.err != nil || tunnel.res.Tunnel.BytesToSandbox != send || tunnel.res.Tunnel.BytesFromSandbox != reply {
				t.Errorf("the tunnel: %+v, %v; want %d bytes to and %d from the sandbox", tunnel.res.Tunnel, tunnel.err, send, reply)
			}
			checkTunnel(t, up, send, reply, sent, recv, n)
			if _, opened := servedBy.Counts(); opened != 1 {
				t.Errorf("the registry that served it opened %d tunnels, want 1", opened)
			}
			if _, opened := other.Counts(); opened != 0 {
				t.Errorf("the other registry opened %d tunnels, want 0", opened)
			}
		})
	}
}

// A MoveStandby whose ctx ends before the wait's Read returned gives up
// (handoff.StayPause) and the wait resumes when it does; a later MoveStandby
// interrupts it again and moves it, and its tunnel runs in the new
// process, exact.
func TestMoveStandbyAbandoned(t *testing.T) {
	const send, reply = 64 << 10, 48 << 10
	forwardtest.CheckLeaks(t)
	old := newFixture(t, standbyConfig)
	up := forwardtest.NewUpstream(t, reply)
	nu, nuReg := newProcess(t, old.gw, func(c *Config) { c.StandbyTimeout = 10 * time.Second })
	var wg sync.WaitGroup
	defer wg.Wait()
	c, _, out := serveOne(t, old.fwd, &wg)
	waitStandby(t, old.reg, 1)
	w := old.reg.waitingStandby()[0]
	ctx, cancel := context.WithCancel(context.Background())
	hold := make(chan struct{})
	w.mu.Lock()
	h := w.c.Conn.(*hookConn)
	h.hold.Store(&hold)
	h.onInterrupt = cancel
	w.mu.Unlock()
	adopted := make(chan *AdoptedStandby, 1)
	var offered atomic.Int64
	s := standbySession(t, nu, never, adopted, &offered)
	res := old.reg.MoveStandby(ctx, handoff.SenderMover(s))
	if res.Moved != 0 || len(res.Stays) != 1 || res.Stayed[handoff.StayPause] != 1 || !errors.Is(res.Stays[0].Err, context.Canceled) {
		t.Fatalf("moved %d, stays %v; want the one to stay: %s", res.Moved, res.Stays, handoff.StayPause)
	}
	second := make(chan handoff.MoveResult[string], 1)
	go func() { second <- old.reg.MoveStandby(context.Background(), handoff.SenderMover(s)) }()
	waitUntil(t, "the second interruption", func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.state == waitInterrupted
	})
	h.hold.Store(nil)
	close(hold)
	res = <-second
	s.Close()
	if res.Moved != 1 || len(res.Stays) != 0 || offered.Load() != 1 {
		t.Fatalf("moved %d, stays %v, offered %d; want the one moved", res.Moved, res.Stays, offered.Load())
	}
	if got := <-out; !isStandbyEnd(got.err, StandbyMoved) {
		t.Errorf("old Serve: %v, want a StandbyEndError %q", got.err, StandbyMoved)
	}
	newOut := serveAdopted(<-adopted, &wg)
	waitStandby(t, nuReg, 1)
	sent, recv, n := runTunnel(t, c, old.gw.Frame(t, "sbx-again", up.Addr()), send, 3)
	if got := <-newOut; got.err != nil || got.res.Tunnel.BytesToSandbox != send {
		t.Errorf("new Serve: %+v, %v", got.res.Tunnel, got.err)
	}
	checkTunnel(t, up, send, reply, sent, recv, n)
	if _, ends := old.reg.Standby(); len(ends) != 1 || ends[StandbyMoved] != 1 {
		t.Errorf("old registry's standby ends %v, want one moved", ends)
	}
}

func isStandbyEnd(err error, end string) bool {
	se, ok := errors.AsType[*StandbyEndError](err)
	return ok && se.End == end
}

type moverFunc func(kind uint16, state []byte, files ...syscall.Conn) (bool, error)

func (f moverFunc) Move(kind uint16, state []byte, files ...syscall.Conn) (bool, error) {
	return f(kind, state, files...)
}

func (moverFunc) Window() int { return 1 }

func readAll(t *testing.T, c net.Conn) ([32]byte, int64) {
	t.Helper()
	h := sha256.New()
	n, err := io.Copy(h, c)
	if err != nil {
		t.Errorf("gateway read: %v", err)
	}
	var sum [32]byte
	copy(sum[:], h.Sum(nil))
	return sum, n
}

// A standby connection's wait in the process that adopted it ends
// StandbyTimeout after it began in the first: one moved after that is
// expired at once, even with its preamble there to read, and is no
// refusal.
func TestMoveStandbyExpiresInNewProcess(t *testing.T) {
	forwardtest.CheckLeaks(t)
	const standby = 300 * time.Millisecond
	old := newFixture(t, standbyConfig) // 10s
	old.verified.Store(true)
	up := forwardtest.NewUpstream(t, 0)
	nu, nuReg := newProcess(t, old.gw, func(c *Config) { c.StandbyTimeout = standby })
	c := old.dial(t)
	defer c.Close()
	waitStandby(t, old.reg, 1)
	time.Sleep(standby + 100*time.Millisecond)
	adopted := make(chan *AdoptedStandby, 1)
	var offered atomic.Int64
	s := standbySession(t, nu, never, adopted, &offered)
	res := old.reg.MoveStandby(context.Background(), handoff.SenderMover(s))
	s.Close()
	if res.Moved != 1 {
		t.Fatalf("moved %d, stays %v; want the one moved", res.Moved, res.Stays)
	}
	a := <-adopted
	// The preamble reaches the adopted socket before it is served.
	frame := old.gw.Frame(t, "sbx-late", up.Addr())
	if _, err := c.Write(frame); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "the preamble in the adopted socket", func() bool { return queued(t, a.Gateway().Conn) >= len(frame) })
	var wg sync.WaitGroup
	out := serveAdopted(a, &wg)
	var got served
	select {
	case got = <-out:
	case <-time.After(10 * time.Second):
		// Its tunnel opened: the gateway's close ends it.
		c.Close()
		got = <-out
		t.Errorf("new Serve still running after 10s")
	}
	wg.Wait()
	if se, ok := errors.AsType[*StandbyEndError](got.err); !ok || se.End != StandbyExpired {
		t.Errorf("new Serve: %v, want a StandbyEndError %q", got.err, StandbyExpired)
	}
	if _, ends := nuReg.Standby(); len(ends) != 1 || ends[StandbyExpired] != 1 {
		t.Errorf("new registry's standby ends %v, want one expired", ends)
	}
	if rej := nuReg.RefusedTunnels(); len(rej) != 0 {
		t.Errorf("new registry refused %v, want nothing", rej)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, _ := io.Copy(io.Discard, c); n != 0 {
		t.Errorf("the gateway read %d bytes from its expired standby connection, want none", n)
	}
	if up.Accepted() != 0 {
		t.Errorf("the target was dialed %d times, want never", up.Accepted())
	}
}

// queued is how many bytes c's socket holds unread.
func queued(t *testing.T, c net.Conn) int {
	t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	rc.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
	return n
}

package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// userspaceFixture is a Dialer carrying tunnels on userspace TLS through a
// front to a forwarder and a paced sandbox (sandbox names the route's).
type userspaceFixture struct {
	p  pki
	d  *Dialer
	fr *front
	up *forwardtest.Upstream
}

func newUserspaceFixture(t *testing.T, sandbox string) *userspaceFixture {
	t.Helper()
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	up := forwardtest.NewPacedUpstream(t, 16<<10, 2*time.Millisecond)
	f := startForwarder(t, p, gw, "127.0.0.0/8")
	d, err := New(Config{TLS: p.client, Signer: gw.Signer, KTLS: ktls.Options{Disable: true}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	fr := startFrontWith(t, p, d, Route{Forwarder: f.addr(), Sandbox: sandbox, Target: up.Addr()}, ktls.Options{Disable: true})
	return &userspaceFixture{p: p, d: d, fr: fr, up: up}
}

// drain runs d.Drain(ctx) and returns the channel its count arrives on.
func drain(ctx context.Context, d *Dialer) <-chan int {
	forced := make(chan int, 1)
	go func() { forced <- d.Drain(ctx) }()
	return forced
}

// Tunnels that end within the grace period run to their orderly end with
// every byte exact both ways, Drain waits for them and forces none, and a
// tunnel asked for meanwhile is refused without a dial: nothing reaches
// the sandbox.
func TestDrainWaitsForTunnels(t *testing.T) {
	const n = 2
	forwardtest.CheckLeaks(t)
	fx := newUserspaceFixture(t, "sbx-drain")
	s := startStreams(t, fx.fr, fx.p.client, fx.d, fx.up, n)
	forced := drain(context.Background(), fx.d)
	// Until the streams end, Drain waits.
	time.Sleep(100 * time.Millisecond)
	select {
	case f := <-forced:
		t.Fatalf("Drain returned %d with %d tunnels open and no deadline", f, n)
	default:
	}

	c, err := tls.Dial("tcp", fx.fr.ln.Addr().String(), &tls.Config{RootCAs: fx.p.client.RootCAs, ServerName: "localhost"})
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(30 * time.Second))
	got, readErr := io.Copy(io.Discard, c)
	c.Close()
	if r := fx.fr.result(t); !errors.Is(r.err, ErrDraining) || r.end != "" || len(r.dials) != 1 || !errors.Is(r.dials[0], ErrDraining) {
		t.Errorf("Carry while draining: end %q, %v, dials %v; want ErrDraining, no end, onDial told so once", r.end, r.err, r.dials)
	}
	if got != 0 || readErr == nil {
		t.Errorf("refused user read %d bytes, error %v: want none, and an error", got, readErr)
	}
	if a := fx.up.Accepted(); a != n {
		t.Errorf("sandbox accepted %d connections, want the %d tunnels' only", a, n)
	}

	s.finish()
	select {
	case f := <-forced:
		if f != 0 {
			t.Errorf("Drain forced %d tunnels, want 0: all ended in time", f)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Drain did not return after the tunnels ended")
	}
	fx.up.Close()
	forwardtest.ExactBothWays(t, s.users, fx.up.Results())
	for range n {
		if r := fx.fr.result(t); r.err != nil || r.end != EndClosed {
			t.Errorf("Carry: end %s, %v; want %s", r.end, r.err, EndClosed)
		}
	}
	if fx.d.Tunnels() != 0 {
		t.Errorf("%d tunnels carried after the drain", fx.d.Tunnels())
	}
}

// A tunnel still open when the grace period ends is ended as a failure
// (EndDrained, ErrDrained), counted, and its Carry has returned when Drain
// returns; its user sees an error, never an orderly end.
func TestDrainForcesAtDeadline(t *testing.T) {
	forwardtest.CheckLeaks(t)
	fx := newUserspaceFixture(t, "sbx-forced")
	s := startStreams(t, fx.fr, fx.p.client, fx.d, fx.up, 1)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	forced := fx.d.Drain(ctx)
	if forced != 1 {
		t.Errorf("Drain forced %d tunnels, want 1", forced)
	}
	if took := time.Since(start); took < 200*time.Millisecond || took > 20*time.Second {
		t.Errorf("Drain took %v: want the grace period, then the relay's end", took)
	}
	// Drain returns as the forced tunnel's Carry does: its relay has
	// ended, its registration is gone.
	if fx.d.Tunnels() != 0 {
		t.Errorf("%d tunnels carried after the drain", fx.d.Tunnels())
	}
	if r := fx.fr.result(t); r.end != EndDrained || !errors.Is(r.err, ErrDrained) {
		t.Errorf("Carry: end %s, %v; want %s and ErrDrained", r.end, r.err, EndDrained)
	}
	s.finish()
	if u := s.users[0]; u.Err == nil {
		t.Errorf("user stream ended without an error after %d bytes read: a cut tunnel must not look complete", u.RecvN)
	}
	// A second Drain finds nothing left, and says the same.
	if f := fx.d.Drain(context.Background()); f != 1 {
		t.Errorf("second Drain: %d, want the 1 the drain forced", f)
	}
}

// dupConn returns a connection on a duplicate of c's descriptor, as the
// process a tunnel moves to holds one.
func dupConn(t *testing.T, c *net.TCPConn) net.Conn {
	t.Helper()
	f, err := c.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// roundTrip sends msg from a to b and fails t unless b reads it whole.
func roundTrip(t *testing.T, what string, a, b net.Conn, msg string) {
	t.Helper()
	b.SetReadDeadline(time.Now().Add(10 * time.Second))
	defer b.SetReadDeadline(time.Time{})
	if _, err := a.Write([]byte(msg)); err != nil {
		t.Fatalf("%s: write: %v", what, err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(b, buf); err != nil || string(buf) != msg {
		t.Fatalf("%s: read %q, %v; want %q", what, buf, err, msg)
	}
}

// A tunnel paused for a move (as MoveTunnels pauses it, here on plain TCP,
// which splices and pauses as kernel TLS does) when the drain's deadline
// passes is not cut while paused: Drain waits for the move's verdict. One
// that moved goes on whole in the process that took it (its sockets
// unharmed, Carry's end EndMoved, none forced); one that resumed here ends
// as drained.
func TestDrainSparesPausedTunnel(t *testing.T) {
	for _, moved := range []bool{false, true} {
		name := "resumed"
		if moved {
			name = "moved"
		}
		t.Run(name, func(t *testing.T) {
			forwardtest.CheckLeaks(t)
			d := newDialer(t, newPKI(t), forwardtest.NewGateway(t, "gw-1"))
			defer d.Close()
			userPeer, user := forwardtest.TCPPair(t)
			defer userPeer.Close()
			tunnel, sandbox := forwardtest.TCPPair(t)
			defer sandbox.Close()
			c := newCarried(Route{Sandbox: "sbx-paused"}, time.Now(), user, tunnel, 0, nil)
			c.onDial = func(*ktls.Conn, error) {}
			c.relay = splice.New(user, tunnel, c.opts)
			force, err := d.tunnels.enter(false)
			if err != nil {
				t.Fatal(err)
			}
			type result struct {
				end End
				err error
			}
			done := make(chan result, 1)
			go func() {
				defer d.tunnels.leave()
				_, end, err := d.carry(c, force)
				done <- result{end, err}
			}()
			waitUntil(t, "the tunnel carried", func() bool { return d.Tunnels() == 1 })
			roundTrip(t, "before the pause", userPeer, sandbox, "to the sandbox")

			c.mu.Lock()
			paused, err := c.relay.Pause(context.Background())
			if err != nil {
				c.mu.Unlock()
				t.Fatalf("Pause: %v", err)
			}
			defer paused.Close()
			past, cancel := context.WithCancel(context.Background())
			cancel()
			forced := drain(past, d)
			time.Sleep(100 * time.Millisecond)
			select {
			case f := <-forced:
				c.mu.Unlock()
				t.Fatalf("Drain returned %d while the tunnel waited for its move's verdict", f)
			default:
			}
			if moved {
				// The other process's descriptors.
				userThere, tunnelThere := dupConn(t, user), dupConn(t, tunnel)
				defer userThere.Close()
				defer tunnelThere.Close()
				d.tunnels.remove(c)
				c.verdict <- moveVerdict{moved: true}
				c.mu.Unlock()
				if r := <-done; r.end != EndMoved || r.err != nil {
					t.Errorf("Carry: end %s, %v; want %s", r.end, r.err, EndMoved)
				}
				if f := <-forced; f != 0 {
					t.Errorf("Drain forced %d, want 0: the tunnel moved", f)
				}
				roundTrip(t, "after the move, to the sandbox", userPeer, userThere, "moved on")
				roundTrip(t, "after the move, from the sandbox", sandbox, tunnelThere, "still whole")
				return
			}
			relay, err := splice.Resume(c.user, c.tunnel, paused, c.opts)
			if err != nil {
				c.mu.Unlock()
				t.Fatal(err)
			}
			c.relay = relay
			c.verdict <- moveVerdict{resumed: true}
			c.mu.Unlock()
			if r := <-done; r.end != EndDrained || !errors.Is(r.err, ErrDrained) {
				t.Errorf("Carry: end %s, %v; want %s and ErrDrained", r.end, r.err, EndDrained)
			}
			if f := <-forced; f != 1 {
				t.Errorf("Drain forced %d, want 1", f)
			}
			userPeer.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadAll(userPeer); err == nil {
				t.Error("the user's side ended in order: a tunnel cut by the drain must not look complete")
			}
		})
	}
}

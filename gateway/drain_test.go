package gateway

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// drainFixture is a Dialer carrying tunnels on userspace TLS through a
// front to a forwarder and a paced sandbox.
type drainFixture struct {
	p  pki
	d  *Dialer
	fr *front
	up *forwardtest.Upstream
}

func newDrainFixture(t *testing.T, sandbox string) *drainFixture {
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
	return &drainFixture{p: p, d: d, fr: fr, up: up}
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
	fx := newDrainFixture(t, "sbx-drain")
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
	fx := newDrainFixture(t, "sbx-forced")
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

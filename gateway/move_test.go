package gateway

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// startStreams opens n user streams (forwardtest.RunStream) through fr,
// once d carries each, and waits for bytes to reach up and for Carry to
// report each tunnel open; finish lets them end, as the test's cleanup
// does.
func startStreams(t *testing.T, fr *front, roots *tls.Config, d *Dialer, up *forwardtest.Upstream, n int) *streams {
	t.Helper()
	s := openStreams(t, fr, roots, d, up, n)
	// Bytes moving on some tunnels say nothing of the others: a tunnel
	// opens at the forwarder's first byte, which a loaded machine may
	// hold back while its user's bytes already flow.
	waitUntil(t, "every tunnel opened", func() bool { return fr.opened.Load() == int32(n) })
	return s
}

// openStreams is startStreams without waiting for the tunnels to open.
func openStreams(t *testing.T, fr *front, roots *tls.Config, d *Dialer, up *forwardtest.Upstream, n int) *streams {
	t.Helper()
	release := make(chan struct{})
	s := &streams{users: make([]*forwardtest.Stream, n), release: sync.OnceFunc(func() { close(release) })}
	start := make(chan struct{})
	startOnce := sync.OnceFunc(func() { close(start) })
	t.Cleanup(func() { startOnce(); s.finish() })
	cfg := &tls.Config{RootCAs: roots.RootCAs, ServerName: "localhost"}
	for i := range n {
		c, err := tls.Dial("tcp", fr.ln.Addr().String(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		s.wg.Go(func() { s.users[i] = forwardtest.RunStream(c, nil, uint64(i+1), start, release) })
	}
	waitUntil(t, "every tunnel carried", func() bool { return d.Tunnels() == n })
	startOnce()
	waitUntil(t, "bytes moving", func() bool { return up.Received() > int64(n)*64<<10 })
	return s
}

// streams is n user streams through a front, moving bytes both ways.
type streams struct {
	users   []*forwardtest.Stream
	wg      sync.WaitGroup
	release func()
}

// finish lets the streams end and waits for them.
func (s *streams) finish() {
	s.release()
	s.wg.Wait()
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Minute); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// adoptingMover moves tunnels to the Dialer to within this process: the
// descriptors are duplicated, as passing them to another process does.
// refuse says, by the offer's index (from 0), whether the other process
// refuses it before adopting it; keep whether it adopts it and then keeps
// it where it was (as when the other process cannot confirm the
// adoption). The adopted tunnels are Run by run once MoveTunnels returned.
type adoptingMover struct {
	t       *testing.T
	to      *Dialer
	refuse  func(offer int) bool
	keep    func(offer int) bool
	offers  int
	adopted []*AdoptedTunnel
}

// Window is 1: the offers' indices are the order MoveTunnels makes them.
func (m *adoptingMover) Window() int { return 1 }

func (m *adoptingMover) Move(kind uint16, state []byte, files ...syscall.Conn) (bool, error) {
	offer := m.offers
	m.offers++
	if kind != handoff.KindGatewayTunnel {
		m.t.Errorf("offer %d: kind %d, want handoff.KindGatewayTunnel", offer, kind)
	}
	if m.refuse != nil && m.refuse(offer) {
		return false, errors.New("the test refuses this tunnel")
	}
	dups := make([]*os.File, len(files))
	for i, f := range files {
		rc, err := f.SyscallConn()
		if err != nil {
			m.t.Fatal(err)
		}
		var fd int
		var derr error
		if err := rc.Control(func(s uintptr) { fd, derr = syscall.Dup(int(s)) }); err != nil || derr != nil {
			m.t.Fatal(err, derr)
		}
		dups[i] = os.NewFile(uintptr(fd), fmt.Sprintf("moved-%d", i))
	}
	defer func() {
		for _, f := range dups {
			f.Close()
		}
	}()
	mt, err := DecodeMovedTunnel(state)
	if err != nil {
		m.t.Errorf("offer %d: %v", offer, err)
		return false, err
	}
	a, err := m.to.AdoptTunnel(mt, dups)
	if err != nil {
		m.t.Errorf("offer %d: %v", offer, err)
		return false, err
	}
	if m.keep != nil && m.keep(offer) {
		a.Discard()
		return false, errors.New("the test kept this tunnel where it was")
	}
	m.adopted = append(m.adopted, a)
	return true, nil
}

// carryResult is an adopted tunnel's Run's outcome.
type carryResult struct {
	stats splice.Stats
	end   End
	err   error
	dials []error
}

// run runs the adopted tunnels and sends each outcome to results; ended
// counts those that ended.
func (m *adoptingMover) run(runs *sync.WaitGroup, results chan<- carryResult, ended *atomic.Int32) {
	for _, a := range m.adopted {
		runs.Go(func() {
			var r carryResult
			r.stats, r.end, r.err = a.Run(func(_ *ktls.Conn, err error) { r.dials = append(r.dials, err) })
			ended.Add(1)
			results <- r
		})
	}
}

// The state of a moving tunnel: its route, its start, whether it was
// reported open, the bytes sent ahead of its relay, both sessions and the
// relay's counters, under a version that a build of another version
// refuses; a state cut anywhere or with more after it is refused. A state
// AdoptTunnel refuses uses none of its descriptors.
func TestMovedTunnelState(t *testing.T) {
	route := Route{Forwarder: "fwd.example:8443", Sandbox: "sbx-state", Target: netip.MustParseAddrPort("10.0.0.7:8080"),
		Client: preamble.ClientIdentity{Addr: netip.MustParseAddrPort("192.0.2.1:5555"), ID: "alice"}}
	opened := time.Date(2026, 12, 5, 8, 0, 0, 0, time.UTC)
	var ps splice.PauseState
	ps.Dirs[splice.AToB].Bytes, ps.Dirs[splice.AToB].SpliceBytes = 10, 10
	ps.Dirs[splice.BToA].Bytes, ps.Dirs[splice.BToA].SpliceBytes, ps.Dirs[splice.BToA].Pending = 20, 20, 5
	mt := MovedTunnel{Dialer: "proxy-digest", Forwarder: route.Forwarder, Sandbox: route.Sandbox, Target: route.Target, Client: route.Client,
		Opened: opened, Open: true, Buffered: 3, User: []byte("user-session"), Tunnel: []byte("tunnel-session"), Relay: ps}
	b, err := mt.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if b[0] != MovedTunnelVersion {
		t.Fatalf("encoding starts with %d, want the version %d", b[0], MovedTunnelVersion)
	}
	back, err := DecodeMovedTunnel(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, mt) {
		t.Errorf("MovedTunnel round trip: %+v, want %+v", back, mt)
	}
	for i := range len(b) {
		if _, err := DecodeMovedTunnel(b[:i]); err == nil {
			t.Fatalf("cut at %d of %d: decoded", i, len(b))
		}
	}
	other := bytes.Clone(b)
	other[0] = MovedTunnelVersion + 1
	for _, c := range []struct {
		name  string
		state []byte
		want  string
	}{
		{"another version", other, "moved tunnel version 3, this build adopts 2"},
		{"version 1 (JSON)", []byte(`{"version":1}`), "moved tunnel version 123"},
		{"trailing", append(bytes.Clone(b), 0), "data after the last field"},
	} {
		if got, err := DecodeMovedTunnel(c.state); err == nil || !strings.Contains(err.Error(), c.want) || got.User != nil {
			t.Errorf("%s: %v; want a refusal saying %q", c.name, err, c.want)
		}
	}

	d := newDialer(t, newPKI(t), forwardtest.NewGateway(t, "gw-1"))
	defer d.Close()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	for _, c := range []struct {
		name  string
		files []*os.File
		want  string
	}{
		// Two sockets and BToA's pipe.
		{"a pipe missing", []*os.File{r, w}, "pipes: 0, want 1"},
		{"a socket missing", []*os.File{r}, "1 descriptors"},
		{"sessions that do not decode", []*os.File{r, w, r}, "the user's session"},
	} {
		mt, err := DecodeMovedTunnel(b)
		if err != nil {
			t.Fatal(err)
		}
		a, err := d.AdoptTunnel(mt, c.files)
		if a != nil || err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: AdoptTunnel: %v, %v; want a refusal saying %q", c.name, a, err, c.want)
		}
		if !bytes.Equal(mt.User, make([]byte, len(mt.User))) || !bytes.Equal(mt.Tunnel, make([]byte, len(mt.Tunnel))) {
			t.Errorf("%s: the refused state's sessions were left as they were: want them wiped", c.name)
		}
		for _, f := range c.files {
			if _, err := f.Stat(); err != nil {
				t.Errorf("%s: a descriptor was closed: %v", c.name, err)
			}
		}
	}
	if d.Tunnels() != 0 {
		t.Errorf("%d tunnels carried after refused adoptions", d.Tunnels())
	}
}

// FuzzMovedTunnel: no input makes DecodeMovedTunnel panic, and a state it
// accepts encodes to exactly its input.
func FuzzMovedTunnel(f *testing.F) {
	var ps splice.PauseState
	ps.Dirs[splice.BToA].Bytes, ps.Dirs[splice.BToA].SpliceBytes, ps.Dirs[splice.BToA].Pending = 20, 20, 5
	mt := MovedTunnel{Dialer: "d", Forwarder: "fwd:8443", Sandbox: "sbx", Target: netip.MustParseAddrPort("10.0.0.7:8080"),
		Client: preamble.ClientIdentity{Addr: netip.MustParseAddrPort("[2001:db8::1]:5555"), ID: "alice"},
		Opened: time.Unix(1, 2), Open: true, Buffered: 3, User: []byte("u"), Tunnel: []byte("t"), Relay: ps}
	b, err := mt.Encode()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		mt, err := DecodeMovedTunnel(b)
		if err != nil {
			return
		}
		again, err := mt.Encode()
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("accepted %x, which encodes as %x, %v", b, again, err)
		}
	})
}

// Tunnels whose sessions run in userspace TLS cannot move: they stay,
// counted by why, the handoff.Mover is never asked, and they run on exact to an
// orderly end.
func TestMoveUserspaceTLSTunnelsStay(t *testing.T) {
	const n = 4
	forwardtest.CheckLeaks(t)
	fx := newUserspaceFixture(t, "sbx-stay")
	p, d, fr, up := fx.p, fx.d, fx.fr, fx.up
	s := startStreams(t, fr, p.client, d, up, n)
	m := &adoptingMover{t: t, to: d}
	res := d.MoveTunnels(context.Background(), m)
	if res.Moved != 0 || m.offers != 0 || res.Stayed[handoff.StayPause] != n || len(res.Stays) != n {
		t.Errorf("moved %d, offered %d, stayed %v; want all %d to stay unoffered: their relays copy (userspace TLS)", res.Moved, m.offers, res.Stayed, n)
	}
	for _, st := range res.Stays {
		var pe *splice.PauseError
		if st.Object.Sandbox != "sbx-stay" || !errors.As(st.Err, &pe) || pe.Reason != splice.PauseCopyPath {
			t.Errorf("stay %+v: want the tunnel's route and a %s refusal", st, splice.PauseCopyPath)
		}
	}
	s.finish()
	up.Close()
	forwardtest.ExactBothWays(t, s.users, up.Results())
	for range n {
		if r := fr.result(t); r.err != nil || r.end != EndClosed || len(r.dials) != 1 || r.dials[0] != nil {
			t.Errorf("Carry: end %s, %v, dials %v; want %s, opened once", r.end, r.err, r.dials, EndClosed)
		}
	}
}

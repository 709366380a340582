package forward

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/tcpfile"
	"github.com/ktlsingress/caddy-ktls/internal/wire"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// Moving a live tunnel to another process (a binary upgrade): its relay
// pauses at a safe point (splice.Relay.Pause), the gateway's connection
// gives up its session (Config.HandOffConn: the kernel TLS state), and the
// two sockets, the pipes holding bytes in flight and a MovedTunnel go to
// the other process (a handoff.Mover), whose Forwarder adopts them (Adopt)
// and resumes the relay. A tunnel the other process does not take resumes
// here, as if nothing had happened. Either way it is in exactly one
// process: the Mover decides which.
//
// The gateways' standby connections, which wait for their first preamble
// byte, move the same way (Registry.MoveStandby, movestandby.go): their
// wait is interrupted, the connection's session and socket go with a
// MovedStandby, and the other process serves it (AdoptStandby), so that a
// gateway that writes its preamble on one during an upgrade has it served
// by whichever process holds the connection then.

// MovedTunnelVersion is the version of MovedTunnel's encoding (its first
// byte): two builds move tunnels only when they agree on it.
const MovedTunnelVersion = 2

// MovedTunnel is a tunnel's state as it moves. Its descriptors travel
// beside it, in this order: the gateway's connection, the target's, then
// the pipes of the directions with bytes pending (AToB first).
type MovedTunnel struct {
	Tunnel TunnelState
	// Conn is the gateway connection's session as Config.HandOffConn
	// encoded it. It holds the session's traffic secrets.
	Conn  []byte
	Relay splice.PauseState
}

// Encode returns m in the current MovedTunnelVersion (internal/wire): the
// tunnel's registration (TunnelState's fields in their order), the
// session's state, then the relay's (its own encoding, with its version).
// The bytes hold the session's secrets: the caller wipes them once sent.
func (m *MovedTunnel) Encode() ([]byte, error) {
	relay, err := m.Relay.Encode()
	if err != nil {
		return nil, err
	}
	w := wire.NewWriter(MovedTunnelVersion, 256+len(m.Conn)+len(relay))
	m.Tunnel.write(w)
	w.Bytes(m.Conn)
	w.Bytes(relay)
	return w.B, nil
}

// DecodeMovedTunnel decodes what Encode wrote, refusing another version, a
// state cut short or with anything after it, and a relay Resume could not
// continue. The decoded Conn is a copy (the caller wipes b, and Adopt
// wipes Conn).
func DecodeMovedTunnel(b []byte) (MovedTunnel, error) {
	r := wire.NewReader(b)
	if v := r.Version(); r.Err() == nil && v != MovedTunnelVersion {
		return MovedTunnel{}, fmt.Errorf("forward: moved tunnel version %d, this build adopts %d", v, MovedTunnelVersion)
	}
	var m MovedTunnel
	m.Tunnel = readTunnelState(r)
	r.Field("conn")
	m.Conn = r.Bytes()
	r.Field("relay")
	relay := r.View()
	err := r.End()
	if err == nil {
		m.Relay, err = splice.DecodePauseState(relay)
	}
	if err != nil {
		clear(m.Conn)
		return MovedTunnel{}, fmt.Errorf("forward: moved tunnel: %w", err)
	}
	return m, nil
}

// movable is what a running tunnel's Serve offers MoveTunnels.
type movable struct {
	f            *Forwarder
	relay        *splice.Relay
	gw, upstream net.Conn
	opts         splice.Options
	verdict      chan moveVerdict // MoveTunnels tells the paused Serve
	mu           sync.Mutex       // guards relay and gw across a kept move
}

// moveVerdict is what became of a paused tunnel: moved, resumed here (on
// movable's relay and gw, read under its mu), or neither: it ends as a
// failure.
type moveVerdict struct {
	moved, resumed bool
}

// MoveTunnels offers every open tunnel to m, up to m.Window() at once, and
// returns what became of them, a tunnel that stays named by its ID. A
// failure of m's session fails every later offer the same way: each is
// counted as such. The moved tunnels' Serve return with Result.Moved.
func (r *Registry) MoveTunnels(ctx context.Context, m handoff.Mover) handoff.MoveResult[uint64] {
	return handoff.MoveAll(m, r.openTunnels(), func(t *Tunnel) uint64 { return t.ID }, func(t *Tunnel) handoff.Offered {
		why, pause, err := t.move(ctx, m)
		return handoff.Offered{Why: why, Err: err, Pause: pause}
	})
}

func (r *Registry) openTunnels() []*Tunnel {
	r.mu.Lock()
	defer r.mu.Unlock()
	list := make([]*Tunnel, 0, len(r.tunnels))
	for _, t := range r.tunnels {
		list = append(list, t)
	}
	return list
}

// move offers t to m: "" when it moved, else why it stays and the error.
func (t *Tunnel) move(ctx context.Context, m handoff.Mover) (stay string, pause time.Duration, err error) {
	mv := t.movable.Load()
	if mv == nil {
		return handoff.StayNotMovable, 0, errors.New("its relay is not running")
	}
	if mv.f.cfg.HandOffConn == nil {
		return handoff.StayNotMovable, 0, errors.New("its forwarder hands off no connection (HandOffConn)")
	}
	mv.mu.Lock()
	defer mv.mu.Unlock()
	start := time.Now()
	paused, err := mv.relay.Pause(ctx)
	if err != nil {
		return handoff.StayPause, 0, err
	}
	defer paused.Close()
	encode := func(connState []byte) ([]byte, []syscall.Conn, error) {
		up, ok := mv.upstream.(syscall.Conn)
		if !ok {
			return nil, nil, fmt.Errorf("the target's connection (%T) has no descriptor to pass", mv.upstream)
		}
		mt := MovedTunnel{Tunnel: t.State(), Conn: connState, Relay: paused.State}
		state, err := mt.Encode()
		if err != nil {
			return nil, nil, err
		}
		files := []syscall.Conn{up}
		for _, p := range paused.Files() {
			files = append(files, p)
		}
		return state, files, nil
	}
	stay, gw, err := mv.f.moveConn(m, handoff.KindTunnel, mv.gw, encode)
	if stay == "" {
		pause = time.Since(start)
		// Its registration goes with it: this registry closes it now, so
		// that a report stream handed off (HandOff) never counts it open
		// here.
		t.Close()
		mv.verdict <- moveVerdict{moved: true}
		return "", pause, nil
	}
	if gw == nil {
		// Its session is lost: the tunnel ends as a failure.
		splice.Abort(mv.upstream)
		mv.verdict <- moveVerdict{}
		return stay, 0, err
	}
	relay, rerr := splice.Resume(gw, mv.upstream, paused, mv.opts)
	if rerr != nil {
		// Unreachable: the state came from this relay; end the tunnel as
		// a failure rather than leave it stopped.
		splice.Abort(gw)
		splice.Abort(mv.upstream)
		mv.verdict <- moveVerdict{}
		return stay, 0, errors.Join(err, rerr)
	}
	mv.relay, mv.gw = relay, gw
	mv.verdict <- moveVerdict{resumed: true}
	return stay, 0, err
}

// moveConn gives up the session of conn, a gateway's connection
// (Config.HandOffConn), and offers it to m as kind: encode builds the
// object's state around the session's (connState) and the descriptors
// that travel after the connection's, which stay the caller's. It returns
// "" when the object moved (conn, given up, is the caller's to close),
// else why it stays, the error, and the connection it stays on: conn when
// its session was not given up (handoff.StayConn), else the one adopted
// back (conn closed), nil when that failed (the socket closes with its
// last descriptor). The session's state and the object's are wiped
// before it returns.
func (f *Forwarder) moveConn(m handoff.Mover, kind uint16, conn net.Conn,
	encode func(connState []byte) (state []byte, files []syscall.Conn, err error)) (stay string, kept net.Conn, err error) {
	connState, sock, err := f.cfg.HandOffConn(conn)
	if err != nil {
		return handoff.StayConn, conn, err
	}
	// The session's state holds its traffic secrets (ktls/handoff.go):
	// wiped here once sent, or adopted back.
	defer clear(connState)
	// From here conn's session is given up: a connection that stays is
	// the one adopted back from its socket, before conn closes it.
	stayHere := func(why string, cause error) (string, net.Conn, error) {
		defer conn.Close() // its descriptors; the session goes on in back
		back, _, err := f.cfg.AdoptConn(connState, sock)
		if err != nil {
			// Unreachable: the state came from this connection.
			return why, nil, errors.Join(cause, fmt.Errorf("adopting it back: %w", err))
		}
		return why, back, cause
	}
	state, files, err := encode(connState)
	if err != nil {
		return stayHere(handoff.StayNotMovable, err)
	}
	defer clear(state)
	if moved, err := m.Move(kind, state, append([]syscall.Conn{sock}, files...)...); !moved {
		return stayHere(handoff.StayRefused, err)
	}
	return "", nil, nil
}

// AdoptedTunnel is a tunnel another process moved here, built and not
// started: Run it once the other process released it, or Discard it.
type AdoptedTunnel struct {
	f        *Forwarder
	tun      *Tunnel
	ctx      context.Context
	relay    *splice.Relay
	gw       net.Conn
	release  func()
	upstream net.Conn
	opts     splice.Options
	base     splice.Stats
}

// Adopt builds, without starting it, the tunnel of a moved state
// (DecodeMovedTunnel) and its descriptors (MoveTunnels' order), registered
// in f's Registry, which must have adopted the tunnel's report stream
// (AdoptReports). It wipes mt.Conn, the session's secrets, whatever it
// returns; the descriptors stay the caller's. A refusal says why; nothing
// was used.
func (f *Forwarder) Adopt(mt MovedTunnel, files []*os.File) (*AdoptedTunnel, error) {
	defer clear(mt.Conn)
	if f.cfg.AdoptConn == nil {
		return nil, errors.New("forward: this forwarder adopts no tunnel (no AdoptConn)")
	}
	if len(files) < 2 {
		return nil, fmt.Errorf("forward: moved tunnel %d: %d descriptors, want the two connections' and the pipes'", mt.Tunnel.ID, len(files))
	}
	paused, err := splice.NewPaused(mt.Relay, files[2:])
	if err != nil {
		return nil, fmt.Errorf("forward: moved tunnel %d: %w", mt.Tunnel.ID, err)
	}
	gw, release, err := f.cfg.AdoptConn(mt.Conn, files[0])
	if err != nil {
		return nil, fmt.Errorf("forward: moved tunnel %d: the gateway's connection: %w", mt.Tunnel.ID, err)
	}
	upstream, err := tcpfile.Conn(files[1]) // its liveness settings as they were
	if err != nil {
		release()
		return nil, fmt.Errorf("forward: moved tunnel %d: the target's connection: %w", mt.Tunnel.ID, err)
	}
	tun, ctx, err := f.cfg.Registry.AdoptTunnel(mt.Tunnel)
	if err != nil {
		release()
		upstream.Close()
		return nil, err
	}
	a := &AdoptedTunnel{f: f, tun: tun, ctx: ctx, gw: gw, release: release, upstream: upstream, base: mt.Relay.Stats()}
	opts, releaseLimits := f.relayOptions(tun)
	relay, err := splice.Resume(gw, upstream, paused, opts)
	if err != nil {
		releaseLimits()
		a.Discard()
		return nil, fmt.Errorf("forward: moved tunnel %d: %w", mt.Tunnel.ID, err)
	}
	a.relay, a.opts = relay, opts
	a.release = func() { releaseLimits(); release() }
	return a, nil
}

// Discard drops an adopted tunnel that the other process kept: this
// process's descriptors close, the sockets and the session stay the other
// process's, and the tunnel leaves the registry.
func (a *AdoptedTunnel) Discard() {
	if a.relay != nil {
		a.relay.Discard()
	}
	a.release()
	a.upstream.Close()
	a.tun.Close()
}

// Run carries the adopted tunnel to its end, as Serve does.
func (a *AdoptedTunnel) Run() (Result, error) {
	defer a.tun.Close()
	defer a.release()
	res, err := a.f.carry(a.ctx, a.tun, a.relay, a.gw, a.upstream, a.opts, a.base)
	res.Tunnel, res.Duration = a.tun.Info(), time.Since(a.tun.Opened)
	return res, err
}

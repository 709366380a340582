package gateway

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/wire"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// Moving a live tunnel to another process (a binary upgrade): the relay
// Carry runs pauses at a safe point (splice.Relay.Pause), both sessions
// are given up (ktls.HandOffConn: the user's, a server session, and the
// forwarder's, a client session), and the two sockets, the pipes holding
// bytes in flight and a MovedTunnel go to the other process (a
// handoff.Mover, of kind handoff.KindGatewayTunnel), whose Dialer adopts
// them (AdoptTunnel) and resumes the relay. A tunnel the other process
// does not take resumes here on its sessions adopted back, as if nothing
// had happened. Either way it is in exactly one process: the Mover
// decides which.

// MovedTunnelVersion is the version of MovedTunnel's encoding (its first
// byte): two builds move gateway tunnels only when they agree on it.
const MovedTunnelVersion = 2

// MovedTunnel is a gateway tunnel's state as it moves. Its descriptors
// travel beside it, in this order: the user's connection, the forwarder's,
// then the pipes of the directions with bytes pending (AToB, user →
// sandbox, first).
type MovedTunnel struct {
	// Dialer is the moving Dialer's Config.MoveName: the other process
	// adopts the tunnel in its Dialer of that name.
	Dialer string
	// Forwarder, Sandbox, Target and Client are the tunnel's Route.
	Forwarder string
	Sandbox   string
	Target    netip.AddrPort
	Client    preamble.ClientIdentity
	// Opened is when Carry began the tunnel.
	Opened time.Time
	// Open says whether the tunnel was reported open (Carry's onDial):
	// when not, the adopting process reports it.
	Open bool
	// Buffered is how many bytes were written to the forwarder before the
	// relay ran (Carry's buffered), which the tunnel's AToB counts.
	Buffered int64
	// User and Tunnel are the user's and the forwarder connection's
	// sessions as ktls.HandOffConn encoded them. They hold the sessions'
	// traffic secrets.
	User   []byte
	Tunnel []byte
	// Relay is the paused relay's state: its counters and pending bytes.
	Relay splice.PauseState
}

// Encode returns m in the current MovedTunnelVersion (internal/wire), its
// fields in their order, the relay's state in its own encoding (with its
// version). The bytes hold the sessions' secrets: the caller wipes them
// once sent.
func (m *MovedTunnel) Encode() ([]byte, error) {
	relay, err := m.Relay.Encode()
	if err != nil {
		return nil, err
	}
	w := wire.NewWriter(MovedTunnelVersion, 256+len(m.User)+len(m.Tunnel)+len(relay))
	w.Text(m.Dialer)
	w.Text(m.Forwarder)
	w.Text(m.Sandbox)
	w.AddrPort(m.Target)
	w.AddrPort(m.Client.Addr)
	w.Text(m.Client.ID)
	w.Time(m.Opened)
	w.Bool(m.Open)
	w.Int(m.Buffered)
	w.Bytes(m.User)
	w.Bytes(m.Tunnel)
	w.Bytes(relay)
	return w.B, nil
}

// DecodeMovedTunnel decodes what Encode wrote, refusing another version, a
// state cut short or with anything after it, and a relay Resume could not
// continue. The decoded sessions are copies (the caller wipes b, and
// AdoptTunnel wipes them).
func DecodeMovedTunnel(b []byte) (MovedTunnel, error) {
	r := wire.NewReader(b)
	if v := r.Version(); r.Err() == nil && v != MovedTunnelVersion {
		return MovedTunnel{}, fmt.Errorf("gateway: moved tunnel version %d, this build adopts %d", v, MovedTunnelVersion)
	}
	var m MovedTunnel
	r.Field("route")
	m.Dialer = r.Text()
	m.Forwarder = r.Text()
	m.Sandbox = r.Text()
	m.Target = r.AddrPort()
	m.Client.Addr = r.AddrPort()
	m.Client.ID = r.Text()
	r.Field("tunnel")
	m.Opened = r.Time()
	m.Open = r.Bool()
	m.Buffered = r.Int()
	r.Field("sessions")
	m.User = r.Bytes()
	m.Tunnel = r.Bytes()
	r.Field("relay")
	relay := r.View()
	err := r.End()
	if err == nil {
		m.Relay, err = splice.DecodePauseState(relay)
	}
	if err != nil {
		clear(m.User)
		clear(m.Tunnel)
		return MovedTunnel{}, fmt.Errorf("gateway: moved tunnel: %w", err)
	}
	return m, nil
}

// moveVerdict is what became of a paused tunnel: moved, resumed here (on
// carried's relay, read under its mu), or neither: it ends as a failure.
type moveVerdict struct {
	moved, resumed bool
}

// registry is a Dialer's tunnels that a relay carries, each from its
// relay's start to its end or move, and the drain's state (Drain): the
// Carry and AdoptedTunnel Run calls in progress, from Carry's admission
// (before its dial) to their return, and the context every relay runs
// under, canceled with ErrDrained when the drain's grace period ends.
type registry struct {
	mu      sync.Mutex
	next    uint64
	tunnels map[uint64]*carried
	// running counts the Carry and Run calls admitted (enter) that have
	// not returned (leave).
	running  int
	draining bool
	// idle is closed and replaced whenever running falls to zero.
	idle chan struct{}
	// force is canceled, with ErrDrained, when a drain's grace period
	// ends: the relays run under it, and the dials of Carry too.
	force       context.Context
	forceCancel context.CancelCauseFunc
	// drained counts the relays that ended because force was canceled.
	drained int
}

// enter admits a Carry (adopted false) or an AdoptedTunnel Run (adopted
// true) and returns the context its dial and relay run under; leave ends
// it. From Drain on a Carry is refused with ErrDraining: a new tunnel
// would only be cut short. An adopted tunnel is not new (it ran in the
// process that moved it) and is admitted, to end with the others.
func (r *registry) enter(adopted bool) (context.Context, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.draining && !adopted {
		return nil, ErrDraining
	}
	r.running++
	return r.forceLocked(), nil
}

// leave ends what enter admitted.
func (r *registry) leave() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.running--
	if r.running == 0 && r.idle != nil {
		close(r.idle)
		r.idle = nil
	}
}

// forceLocked returns r.force, made on first use.
func (r *registry) forceLocked() context.Context {
	if r.force == nil {
		r.force, r.forceCancel = context.WithCancelCause(context.Background())
	}
	return r.force
}

func (r *registry) add(c *carried) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.tunnels == nil {
		r.tunnels = map[uint64]*carried{}
	}
	r.next++
	c.id = r.next
	r.tunnels[c.id] = c
}

func (r *registry) remove(c *carried) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.tunnels, c.id)
}

func (r *registry) list() []*carried {
	r.mu.Lock()
	defer r.mu.Unlock()
	list := make([]*carried, 0, len(r.tunnels))
	for _, c := range r.tunnels {
		list = append(list, c)
	}
	return list
}

// Tunnels returns how many tunnels d's relays carry now: Carry's and
// AdoptedTunnel Run's.
func (d *Dialer) Tunnels() int {
	d.tunnels.mu.Lock()
	defer d.tunnels.mu.Unlock()
	return len(d.tunnels.tunnels)
}

// MoveTunnels offers every tunnel d carries to m, up to m.Window() at once,
// and returns what became of them, a tunnel that stays named by its route.
// The moved tunnels' Carry return EndMoved. A failure of m's session fails
// every later offer the same way: each is counted as refused.
func (d *Dialer) MoveTunnels(ctx context.Context, m handoff.Mover) handoff.MoveResult[Route] {
	return handoff.MoveAll(m, d.tunnels.list(), func(c *carried) Route { return c.route }, func(c *carried) handoff.Offered {
		why, pause, err := d.move(ctx, c, m)
		return handoff.Offered{Why: why, Err: err, Pause: pause}
	})
}

// move offers c to m: "" when it moved, else why it stays and the error.
// Once the relay paused, c's carry is told the verdict, and runs on (on
// the sessions adopted back) unless the tunnel moved.
func (d *Dialer) move(ctx context.Context, c *carried, m handoff.Mover) (stay string, pause time.Duration, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	start := time.Now()
	paused, err := c.relay.Pause(ctx)
	if err != nil {
		return handoff.StayPause, 0, err
	}
	defer paused.Close()
	stay, err = d.moveSessions(c, m, paused)
	if stay == "" {
		// Its registration goes with it: MoveTunnels returns with the
		// moved tunnels carried by the other process alone.
		d.tunnels.remove(c)
		c.verdict <- moveVerdict{moved: true}
		return "", time.Since(start), nil
	}
	if c.user == nil || c.tunnel == nil {
		// A session is lost: the tunnel ends as a failure.
		for _, conn := range []net.Conn{c.user, c.tunnel} {
			if conn != nil {
				splice.Abort(conn)
			}
		}
		c.verdict <- moveVerdict{}
		return stay, 0, err
	}
	relay, rerr := splice.Resume(c.user, c.tunnel, paused, c.opts)
	if rerr != nil {
		// Unreachable: the state came from this relay; end the tunnel as
		// a failure rather than leave it stopped.
		splice.Abort(c.user)
		splice.Abort(c.tunnel)
		c.verdict <- moveVerdict{}
		return stay, 0, errors.Join(err, rerr)
	}
	c.relay = relay
	c.verdict <- moveVerdict{resumed: true}
	return stay, 0, err
}

// moveSessions gives up both sessions of c's paused relay and offers them
// to m with c's state. It returns "" when the tunnel moved, else why it
// stays and the error, with c.user and c.tunnel the connections it stays
// on: those it had where a session was not given up, else the ones
// adopted back (the old ones closed), nil where that failed (the socket
// closes with its last descriptor). When the tunnel moved, c.user and
// c.tunnel, given up, are the caller's to close. The sessions' states and
// the tunnel's are wiped before it returns.
func (d *Dialer) moveSessions(c *carried, m handoff.Mover, paused *splice.Paused) (stay string, err error) {
	userState, userSock, err := ktls.HandOffConn(c.user)
	if err != nil {
		return handoff.StayConn, err
	}
	defer clear(userState)
	// From here a session given up stays here as the one adopted back.
	stayHere := func(why string, cause error, tunnelState []byte, tunnelSock syscall.Conn) (string, error) {
		var uerr, terr error
		c.user, uerr = adoptBack("user's", c.user, userState, userSock, d.cfg.UserKTLS)
		if tunnelSock != nil {
			c.tunnel, terr = adoptBack("forwarder's", c.tunnel, tunnelState, tunnelSock, d.cfg.KTLS)
			if kc, ok := c.tunnel.(*ktls.Conn); ok {
				c.session.Store(kc)
			}
		}
		return why, errors.Join(cause, uerr, terr)
	}
	tunnelState, tunnelSock, err := ktls.HandOffConn(c.tunnel)
	if err != nil {
		return stayHere(handoff.StayConn, err, nil, nil)
	}
	defer clear(tunnelState)
	r := c.route
	mt := MovedTunnel{Dialer: d.cfg.MoveName, Forwarder: r.Forwarder, Sandbox: r.Sandbox, Target: r.Target, Client: r.Client,
		Opened: c.opened, Open: c.isOpen.Load(), Buffered: c.buffered, User: userState, Tunnel: tunnelState, Relay: paused.State}
	state, err := mt.Encode()
	if err != nil {
		return stayHere(handoff.StayNotMovable, err, tunnelState, tunnelSock)
	}
	defer clear(state)
	files := []syscall.Conn{userSock, tunnelSock}
	for _, p := range paused.Files() {
		files = append(files, p)
	}
	if moved, err := m.Move(handoff.KindGatewayTunnel, state, files...); !moved {
		return stayHere(handoff.StayRefused, err, tunnelState, tunnelSock)
	}
	return "", nil
}

// adoptBack returns the connection that continues conn's session, given
// up as state and sock (conn's socket): adopted with opts, then conn's own
// descriptors closed; nil and the error when that fails (unreachable: the
// state came from conn).
func adoptBack(side string, conn net.Conn, state []byte, sock syscall.Conn, opts ktls.Options) (net.Conn, error) {
	defer conn.Close() // its descriptors; the session goes on in back
	back, _, err := ktls.AdoptConn(opts)(state, sock)
	if err != nil {
		return nil, fmt.Errorf("adopting the %s session back: %w", side, err)
	}
	return back, nil
}

// AdoptedTunnel is a tunnel another process moved here, built and not
// started: Run it once the other process released it, or Discard it.
type AdoptedTunnel struct {
	// Route is the tunnel's, and Opened when Carry began it in the process
	// it came from.
	Route  Route
	Opened time.Time
	d      *Dialer
	c      *carried
	// release drops both adopted sessions, left to the other process.
	release func()
}

// AdoptTunnel builds, without starting it, the tunnel of a moved state
// (DecodeMovedTunnel) and its descriptors (MoveTunnels' order): both
// sessions adopted (ktls.AdoptConn: the user's with Config.UserKTLS, the
// forwarder's with Config.KTLS) and the relay resumed where it paused. It
// wipes mt's sessions, their secrets, whatever it returns; the
// descriptors stay the caller's. A refusal says why; nothing was used.
func (d *Dialer) AdoptTunnel(mt MovedTunnel, files []*os.File) (*AdoptedTunnel, error) {
	defer clear(mt.User)
	defer clear(mt.Tunnel)
	r := Route{Forwarder: mt.Forwarder, Sandbox: mt.Sandbox, Target: mt.Target, Client: mt.Client}
	if len(files) < 2 {
		return nil, fmt.Errorf("gateway: moved tunnel %s: %d descriptors, want the two sessions' and the pipes'", r, len(files))
	}
	paused, err := splice.NewPaused(mt.Relay, files[2:])
	if err != nil {
		return nil, fmt.Errorf("gateway: moved tunnel %s: %w", r, err)
	}
	user, releaseUser, err := ktls.AdoptConn(d.cfg.UserKTLS)(mt.User, files[0])
	if err != nil {
		return nil, fmt.Errorf("gateway: moved tunnel %s: the user's session: %w", r, err)
	}
	tunnel, releaseTunnel, err := ktls.AdoptConn(d.cfg.KTLS)(mt.Tunnel, files[1])
	if err != nil {
		releaseUser()
		return nil, fmt.Errorf("gateway: moved tunnel %s: the forwarder's session: %w", r, err)
	}
	c := newCarried(r, mt.Opened, user, tunnel, mt.Buffered, nil)
	c.isOpen.Store(mt.Open)
	relay, err := splice.Resume(user, tunnel, paused, c.opts)
	if err != nil {
		releaseUser()
		releaseTunnel()
		return nil, fmt.Errorf("gateway: moved tunnel %s: %w", r, err)
	}
	c.relay = relay
	return &AdoptedTunnel{Route: r, Opened: mt.Opened, d: d, c: c, release: func() { releaseUser(); releaseTunnel() }}, nil
}

// Discard drops an adopted tunnel that the other process kept: this
// process's descriptors close, the sockets and the sessions stay the other
// process's.
func (a *AdoptedTunnel) Discard() {
	a.c.relay.Discard()
	a.release()
}

// Run carries the adopted tunnel to its end (or its next move) as Carry
// does, and returns what Carry returns: its counts from the tunnel's
// start, in whichever process, its End and the relay's error. onDial is
// told whether the tunnel opened unless the process it came from already
// said it did (as Carry's onDial).
func (a *AdoptedTunnel) Run(onDial func(tunnel *ktls.Conn, err error)) (splice.Stats, End, error) {
	if onDial == nil {
		onDial = func(*ktls.Conn, error) {}
	}
	a.c.onDial = onDial
	force, _ := a.d.tunnels.enter(true)
	defer a.d.tunnels.leave()
	return a.d.carry(a.c, force)
}

package gateway

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// Relay carries a user's connection through tunnel, a connection Dial
// returned, until both directions end, and closes both. buffered are
// bytes already read from user (a layer that read ahead), sent first.
// Where user's receive side and tunnel's send side are in the kernel (a
// kTLS session on each side), and the other way round, the bytes move
// with splice(2) and never enter userspace: the kernel opens the user's
// records and seals the forwarder's. Direction AToB is user → sandbox.
//
// The ends travel on: an orderly end on one side half-closes the other; a
// forwarder's refusal (EndRefused, before the sandbox sent a byte) ends
// user as refused too (its Refuse: access_denied on a kTLS session), as
// does the forwarder's refusal of the gateway's certificate
// (CertificateAlert; with TLS 1.3 it arrives after Dial returned), and
// any failure ends both sides as failures. The forwarder ends every tunnel
// it ends in order with close_notify, so the tunnel's end without one (a
// forwarder that died, or a reset the kernel reported as an end) is a
// failure too, never an orderly end for the user. opts.Refused and
// opts.RequireCloseNotify[BToA] are set here.
func Relay(ctx context.Context, user net.Conn, buffered []byte, tunnel net.Conn, opts splice.Options) (splice.Stats, error) {
	opts = relayOptions(opts)
	if st, err := sendAhead(user, buffered, tunnel, opts); err != nil {
		return st, err
	}
	st, err := splice.Run(ctx, user, tunnel, opts)
	return withAhead(st, int64(len(buffered))), err
}

// relayOptions returns opts with what Relay sets: the forwarder's
// refusals, and close_notify required of the forwarder's side.
func relayOptions(opts splice.Options) splice.Options {
	opts.Refused = func(err error) bool {
		_, cert := CertificateAlert(err)
		return cert || Refused(err)
	}
	opts.RequireCloseNotify[splice.BToA] = true
	return opts
}

// sendAhead writes buffered, bytes read from user before its relay, to
// tunnel. When the write fails it ends both connections as failures and
// returns what Relay returns: the bytes written, and the error.
func sendAhead(user net.Conn, buffered []byte, tunnel net.Conn, opts splice.Options) (splice.Stats, error) {
	if len(buffered) == 0 {
		return splice.Stats{}, nil
	}
	n, err := tunnel.Write(buffered)
	if opts.OnBytes != nil && n > 0 {
		opts.OnBytes(splice.AToB, n)
	}
	if err == nil {
		return splice.Stats{}, nil
	}
	splice.Abort(user)
	splice.Abort(tunnel)
	return withAhead(splice.Stats{}, int64(n)), fmt.Errorf("gateway: bytes buffered before the tunnel: %w", err)
}

// withAhead returns st with the n bytes sendAhead wrote counted in AToB.
func withAhead(st splice.Stats, n int64) splice.Stats {
	st.AToB.Bytes += n
	st.AToB.CopyBytes += n
	return st
}

// RelayEnd is the End of a relay that returned st and err: how the
// forwarder's side ended.
func RelayEnd(st splice.Stats, err error) End {
	if err == nil {
		return EndClosed
	}
	if e := st.BToA.Err; e != nil && Refused(e) && st.BToA.Bytes == 0 {
		return EndRefused
	}
	return EndFailed
}

// Carry carries a user's connection to r: it dials the tunnel and relays
// user through it (Relay) until both directions end. dialCtx bounds the
// dial only; the relay runs until its ends, outliving whatever asked for
// it (a configuration reload ends no tunnel). While it relays, the tunnel
// may move to another process (MoveTunnels): Carry then returns its
// counts at the move and EndMoved, and the other process's AdoptedTunnel
// carries it on and reports its end.
//
// onDial, when set, is told once whether the tunnel opened: with the
// tunnel and a nil error at the forwarder's first byte, or once the tunnel
// ended any way but by refusing the gateway's certificate; with a
// *DialError when Dial failed or the forwarder refused the certificate
// before its first byte (with TLS 1.3 that refusal comes after Dial
// returned). A tunnel that moved before it opened is not reported here:
// the adopting process's AdoptedTunnel.Run reports it. A tunnel that did
// not open returns that *DialError, has ended user as refused, and nothing
// of user's reached the sandbox; one that opened returns the relay's
// counts, its End and the relay's error.
//
// A user that left before the tunnel opened (ErrUserGone: it reset its
// connection, or ended it without close_notify, with nothing sent to
// carry) is not served: Carry checks before it dials, and again once the
// forwarder's connection is ready, before the preamble, so the forwarder
// does no work for it either; that connection is kept as a standby one
// where the Dialer keeps them (Config.Standby), else closed in order. Its
// user is closed, onDial told ErrUserGone, which Carry returns.
//
// While d drains (Drain) Carry dials nothing: it ends user as refused,
// tells onDial ErrDraining and returns it. A tunnel that Drain's deadline
// ended returns EndDrained and an error wrapping ErrDrained.
func (d *Dialer) Carry(dialCtx context.Context, r Route, user net.Conn, buffered []byte, onDial func(tunnel *ktls.Conn, err error)) (splice.Stats, End, error) {
	if onDial == nil {
		onDial = func(*ktls.Conn, error) {}
	}
	force, err := d.tunnels.enter(false)
	if err != nil {
		// Draining: nothing is dialed.
		splice.Refuse(user)
		onDial(nil, err)
		return splice.Stats{}, "", err
	}
	defer d.tunnels.leave()
	start := time.Now()
	// The standby refill waits for the forwarder's first byte (the
	// tunnel's end, or standbyRefillWait at most): its handshakes then
	// never compete with this tunnel's opening for the CPU.
	refill := sync.OnceFunc(func() { d.standby.refill(r.Forwarder) })
	var refillTimer *time.Timer
	dialCtx, stop := withForce(dialCtx, force)
	tunnel, err := d.dial(dialCtx, r, userGone(user, buffered), func() { refillTimer = time.AfterFunc(standbyRefillWait, refill) })
	stop()
	if refillTimer != nil {
		defer func() { refillTimer.Stop(); refill() }()
	}
	if errors.Is(err, ErrUserGone) {
		user.Close()
		onDial(nil, err)
		return splice.Stats{}, "", err
	}
	if err != nil {
		splice.Refuse(user)
		onDial(nil, err)
		return splice.Stats{}, "", err
	}
	c := newCarried(r, start, user, tunnel, int64(len(buffered)), refill)
	c.onDial = onDial
	if st, err := sendAhead(user, buffered, tunnel, c.opts); err != nil {
		c.open()
		return st, RelayEnd(st, err), err
	}
	c.relay = splice.New(user, tunnel, c.opts)
	return d.carry(c, force)
}

// ErrUserGone is what Carry returns, and tells onDial, when its user left
// before the tunnel opened: nothing was sent to the forwarder.
var ErrUserGone = errors.New("gateway: the user left before the tunnel opened (a reset, or an end without close_notify): nothing was sent to the forwarder")

// userGone returns whether user has left with nothing to carry: only a
// connection that can tell (ktls.Conn.Gone), and nothing buffered.
func userGone(user net.Conn, buffered []byte) func() bool {
	g, ok := user.(interface{ Gone() bool })
	if !ok || len(buffered) > 0 {
		return func() bool { return false }
	}
	return g.Gone
}

// withForce returns ctx, canceled with force's cause as well once force
// is done, and the function that releases it.
func withForce(ctx, force context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.AfterFunc(force, func() { cancel(context.Cause(force)) })
	return ctx, func() { stop(); cancel(nil) }
}

// carried is a tunnel that Carry, or an AdoptedTunnel's Run, relays: what
// its end and a move (MoveTunnels) need.
type carried struct {
	id       uint64 // in its Dialer's registry
	route    Route
	opened   time.Time // when Carry began, in whichever process
	buffered int64     // bytes sendAhead wrote, counted in AToB at the end
	// onOpen is called once as the tunnel opens, before onDial.
	onOpen func()
	onDial func(tunnel *ktls.Conn, err error)
	isOpen atomic.Bool
	// session is the forwarder connection as onDial is told it: the one
	// the relay carries.
	session atomic.Pointer[ktls.Conn]
	opts    splice.Options
	verdict chan moveVerdict // MoveTunnels tells the paused relay's carry
	mu      sync.Mutex       // guards relay, user and tunnel across a kept move
	relay   *splice.Relay
	// user and tunnel are the connections the relay carries: the user's
	// session and the forwarder's.
	user, tunnel net.Conn
}

// newCarried returns the carried tunnel of r between user and tunnel, its
// relay not yet built.
func newCarried(r Route, opened time.Time, user, tunnel net.Conn, buffered int64, onOpen func()) *carried {
	c := &carried{route: r, opened: opened, buffered: buffered, onOpen: onOpen, user: user, tunnel: tunnel, verdict: make(chan moveVerdict, 1)}
	if kc, ok := tunnel.(*ktls.Conn); ok {
		c.session.Store(kc)
	}
	c.opts = relayOptions(splice.Options{OnBytes: func(dir splice.Direction, _ int) {
		if dir == splice.BToA && !c.isOpen.Load() {
			c.open()
		}
	}})
	return c
}

// open reports the tunnel open, once.
func (c *carried) open() {
	if c.isOpen.CompareAndSwap(false, true) {
		if c.onOpen != nil {
			c.onOpen()
		}
		c.onDial(c.session.Load(), nil)
	}
}

// carry runs c's relay, registered in d's registry for MoveTunnels, to
// the tunnel's end or its move, and returns what Carry returns. The relay
// runs under force (registry.enter): Drain cancels it at its deadline,
// and a relay resumed after a move that failed runs under it again, so a
// tunnel paused for a move is never cut mid-move: it moves whole, or ends
// here once it resumed.
func (d *Dialer) carry(c *carried, force context.Context) (splice.Stats, End, error) {
	d.tunnels.add(c)
	defer d.tunnels.remove(c)
	relay := c.relay
	for {
		st, err := relay.Run(force)
		if errors.Is(err, splice.ErrPaused) {
			v := <-c.verdict
			c.mu.Lock()
			var user, tunnel net.Conn
			relay, user, tunnel = c.relay, c.user, c.tunnel
			c.mu.Unlock()
			switch {
			case v.moved:
				// Their sessions went with the tunnel: Close releases this
				// process's descriptors only.
				user.Close()
				tunnel.Close()
				return withAhead(st, c.buffered), EndMoved, nil
			case v.resumed:
				continue
			}
			err = errors.New("gateway: the tunnel did not resume after a move that failed")
		}
		st, end, err := d.ended(c, st, err)
		if end == EndFailed && errors.Is(err, ErrDrained) {
			end = EndDrained
			d.tunnels.countDrained()
		}
		return st, end, err
	}
}

// ended is what Carry returns for c's relay that ended with st and err.
func (d *Dialer) ended(c *carried, st splice.Stats, err error) (splice.Stats, End, error) {
	st = withAhead(st, c.buffered)
	if st.BToA.Bytes == 0 {
		if de := d.CertificateRefusal(c.route, st.BToA.Err); de != nil {
			// The relay has ended user as refused.
			c.onDial(nil, de)
			return st, "", de
		}
	}
	c.open()
	return st, RelayEnd(st, err), err
}

package gateway

import (
	"context"
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
	if len(buffered) > 0 {
		n, err := tunnel.Write(buffered)
		if opts.OnBytes != nil && n > 0 {
			opts.OnBytes(splice.AToB, n)
		}
		if err != nil {
			splice.Abort(user)
			splice.Abort(tunnel)
			st := splice.Stats{}
			st.AToB.Bytes, st.AToB.CopyBytes = int64(n), int64(n)
			return st, fmt.Errorf("gateway: bytes buffered before the tunnel: %w", err)
		}
	}
	opts.Refused = func(err error) bool {
		_, cert := CertificateAlert(err)
		return cert || Refused(err)
	}
	opts.RequireCloseNotify[splice.BToA] = true
	st, err := splice.Run(ctx, user, tunnel, opts)
	if len(buffered) > 0 {
		st.AToB.Bytes += int64(len(buffered))
		st.AToB.CopyBytes += int64(len(buffered))
	}
	return st, err
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
// it (a configuration reload ends no tunnel).
//
// onDial, when set, is told once whether the tunnel opened: with the
// tunnel and a nil error at the forwarder's first byte, or once the tunnel
// ended any way but by refusing the gateway's certificate; with a
// *DialError when Dial failed or the forwarder refused the certificate
// before its first byte (with TLS 1.3 that refusal comes after Dial
// returned). A tunnel that did not open returns that *DialError, has ended
// user as refused, and nothing of user's reached the sandbox; one that
// opened returns the relay's counts, its End and the relay's error.
func (d *Dialer) Carry(dialCtx context.Context, r Route, user net.Conn, buffered []byte, onDial func(tunnel *ktls.Conn, err error)) (splice.Stats, End, error) {
	if onDial == nil {
		onDial = func(*ktls.Conn, error) {}
	}
	// The standby refill waits for the forwarder's first byte (the
	// tunnel's end, or standbyRefillWait at most): its handshakes then
	// never compete with this tunnel's opening for the CPU.
	refill := sync.OnceFunc(func() { d.standby.refill(r.Forwarder) })
	var refillTimer *time.Timer
	tunnel, err := d.dial(dialCtx, r, func() { refillTimer = time.AfterFunc(standbyRefillWait, refill) })
	if refillTimer != nil {
		defer func() { refillTimer.Stop(); refill() }()
	}
	if err != nil {
		splice.Refuse(user)
		onDial(nil, err)
		return splice.Stats{}, "", err
	}
	var opened atomic.Bool
	open := func() {
		if opened.CompareAndSwap(false, true) {
			refill()
			onDial(tunnel, nil)
		}
	}
	opts := splice.Options{OnBytes: func(dir splice.Direction, _ int) {
		if dir == splice.BToA && !opened.Load() {
			open()
		}
	}}
	st, err := Relay(context.Background(), user, buffered, tunnel, opts)
	if st.BToA.Bytes == 0 {
		if de := d.CertificateRefusal(r, st.BToA.Err); de != nil {
			// Relay has ended user as refused.
			onDial(nil, de)
			return st, "", de
		}
	}
	open()
	return st, RelayEnd(st, err), err
}

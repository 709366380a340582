package forward

import (
	"context"
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/wire"
)

// Moving a standby connection (standby.go) to another process: its wait
// for the first preamble byte is interrupted (a read deadline in the past;
// the waiter parks once its read returned with nothing), the gateway's
// connection gives up its session (Config.HandOffConn) and its socket and
// a MovedStandby go to the other process, whose Forwarder adopts it
// (AdoptStandby) and serves it as any connection: the wait goes on there
// until StandbyTimeout after it began here, and the preamble the gateway
// writes opens its tunnel there. A byte that arrives as the wait is
// interrupted wins: the connection is then a tunnel's, here, and is not
// offered. One the other process does not take goes on waiting here, as if
// nothing had happened.

// MovedStandbyVersion is the version of MovedStandby's encoding (its first
// byte): two builds move standby connections only when they agree on it.
const MovedStandbyVersion = 2

// MovedStandby is a standby connection's state as it moves: the Gateway
// fields the other process serves it with. Its one descriptor, the
// gateway connection's socket, travels beside it.
type MovedStandby struct {
	// Forwarder is the moving Forwarder's Config.MoveName.
	Forwarder           string
	Peer                string
	Binding             []byte
	Certificate         string
	CertificateNames    []string
	CertificateVerified bool
	// StandbyBegan is when its wait for the first preamble byte began
	// (Gateway.StandbyBegan).
	StandbyBegan time.Time
	// Conn is the gateway connection's session as Config.HandOffConn
	// encoded it. It holds the session's traffic secrets.
	Conn []byte
}

// Encode returns m in the current MovedStandbyVersion (internal/wire), its
// fields in their order. The bytes hold the session's secrets: the caller
// wipes them once sent.
func (m *MovedStandby) Encode() []byte {
	w := wire.NewWriter(MovedStandbyVersion, 256+len(m.Binding)+len(m.Conn))
	w.Text(m.Forwarder)
	w.Text(m.Peer)
	w.Bytes(m.Binding)
	w.Text(m.Certificate)
	w.Texts(m.CertificateNames)
	w.Bool(m.CertificateVerified)
	w.Time(m.StandbyBegan)
	w.Bytes(m.Conn)
	return w.B
}

// DecodeMovedStandby decodes what Encode wrote, refusing another version
// and a state cut short or with anything after it. The decoded Conn is a
// copy (the caller wipes b, and AdoptStandby wipes Conn).
func DecodeMovedStandby(b []byte) (MovedStandby, error) {
	r := wire.NewReader(b)
	if v := r.Version(); r.Err() == nil && v != MovedStandbyVersion {
		return MovedStandby{}, fmt.Errorf("forward: moved standby connection version %d, this build adopts %d", v, MovedStandbyVersion)
	}
	var m MovedStandby
	r.Field("standby")
	m.Forwarder = r.Text()
	m.Peer = r.Text()
	m.Binding = r.Bytes()
	m.Certificate = r.Text()
	m.CertificateNames = r.Texts()
	m.CertificateVerified = r.Bool()
	m.StandbyBegan = r.Time()
	r.Field("conn")
	m.Conn = r.Bytes()
	if err := r.End(); err != nil {
		clear(m.Conn)
		return MovedStandby{}, fmt.Errorf("forward: moved standby connection: %w", err)
	}
	return m, nil
}

// MoveStandby offers every standby connection that waits for its first
// preamble byte to m, up to m.Window() at once, and returns what became of
// them, one that stays named by its gateway (Gateway.Peer). A connection
// whose first byte arrives meanwhile is no standby connection any more: it
// is neither offered nor counted, and opens its tunnel here. The moved
// connections' Serve return a StandbyEndError (StandbyMoved); the others
// wait on, until StandbyTimeout after their wait began, as if nothing had
// happened. Calls at once each skip the connections another is moving.
func (r *Registry) MoveStandby(ctx context.Context, m handoff.Mover) handoff.MoveResult[string] {
	return handoff.MoveAll(m, r.waitingStandby(), func(w *standbyWait) string { return w.c.Peer }, func(w *standbyWait) handoff.Offered {
		offered, why, err := w.move(ctx, m)
		return handoff.Offered{Skipped: !offered, Why: why, Err: err}
	})
}

func (r *Registry) waitingStandby() []*standbyWait {
	r.mu.Lock()
	defer r.mu.Unlock()
	list := make([]*standbyWait, 0, len(r.standbyWaits))
	for w := range r.standbyWaits {
		list = append(list, w)
	}
	return list
}

// move interrupts w's wait and offers its connection to m: offered false
// when it was no standby connection by then (its first byte came, it
// ended, or another call moves it), else "" when it moved, or why it
// stays and the error.
func (w *standbyWait) move(ctx context.Context, m handoff.Mover) (offered bool, stay string, err error) {
	w.mu.Lock()
	switch w.state {
	case waitStarting, waitReading, waitAbandoned:
	default:
		w.mu.Unlock()
		return false, "", nil
	}
	if w.f.cfg.HandOffConn == nil {
		w.mu.Unlock()
		return true, handoff.StayNotMovable, errors.New("its forwarder hands off no connection (HandOffConn)")
	}
	if err := ctx.Err(); err != nil {
		w.mu.Unlock()
		return true, handoff.StayPause, context.Cause(ctx)
	}
	if err := w.c.Conn.SetReadDeadline(time.Unix(1, 0)); err != nil {
		w.mu.Unlock()
		return true, handoff.StayConn, fmt.Errorf("interrupting its wait: %w", err)
	}
	w.state = waitInterrupted
	w.mu.Unlock()
	var parked bool
	select {
	case parked = <-w.report:
	case <-ctx.Done():
		w.mu.Lock()
		if w.state == waitInterrupted {
			// Its read has not returned yet: it resumes when it does.
			w.state = waitAbandoned
			w.mu.Unlock()
			return true, handoff.StayPause, context.Cause(ctx)
		}
		parked = <-w.report // sent under mu, before the state changed
		w.mu.Unlock()
	}
	if !parked {
		return false, "", nil
	}
	why, err := w.handOff(m)
	return true, why, err
}

// handOff moves the connection of w's parked wait to m, and tells the
// wait what became of it.
func (w *standbyWait) handOff(m handoff.Mover) (stay string, err error) {
	c, f := w.c, w.f
	conn := c.Conn
	if c.Unwrap != nil {
		var buffered []byte
		if conn, buffered = c.Unwrap(); len(buffered) > 0 {
			// Unreachable while its wait read nothing: bytes the
			// wrapper holds are read before the socket's.
			w.verdict <- standbyVerdict{}
			return handoff.StayConn, fmt.Errorf("%d bytes of the gateway's are buffered above its connection", len(buffered))
		}
	}
	encode := func(connState []byte) ([]byte, []syscall.Conn, error) {
		ms := MovedStandby{Forwarder: f.cfg.MoveName, Peer: c.Peer, Binding: c.Binding,
			Certificate: c.Certificate, CertificateNames: c.CertificateNames, CertificateVerified: c.CertificateVerified,
			StandbyBegan: c.StandbyBegan, Conn: connState}
		return ms.Encode(), nil, nil
	}
	stay, kept, err := f.moveConn(m, handoff.KindStandby, conn, encode)
	switch {
	case stay == "":
		w.verdict <- standbyVerdict{moved: true}
	case kept == nil:
		w.verdict <- standbyVerdict{err: err}
	case kept == conn:
		w.verdict <- standbyVerdict{} // the wait goes on as it was
	default:
		w.verdict <- standbyVerdict{conn: kept}
	}
	return stay, err
}

// AdoptedStandby is a standby connection another process moved here,
// built and not served: Serve it once the other process released it, or
// Discard it.
type AdoptedStandby struct {
	f       *Forwarder
	gw      Gateway
	release func()
}

// AdoptStandby builds, without serving it, the standby connection of a
// moved state (DecodeMovedStandby) and its descriptor (MoveStandby's). It
// wipes ms.Conn, the session's secrets, whatever it returns; the
// descriptor stays the caller's. A refusal says why; nothing was used.
func (f *Forwarder) AdoptStandby(ms MovedStandby, files []*os.File) (*AdoptedStandby, error) {
	defer clear(ms.Conn)
	if f.cfg.AdoptConn == nil {
		return nil, errors.New("forward: this forwarder adopts no standby connection (no AdoptConn)")
	}
	if len(files) != 1 {
		return nil, fmt.Errorf("forward: moved standby connection of %s: %d descriptors, want 1", ms.Peer, len(files))
	}
	conn, release, err := f.cfg.AdoptConn(ms.Conn, files[0])
	if err != nil {
		return nil, fmt.Errorf("forward: moved standby connection of %s: %w", ms.Peer, err)
	}
	gw := Gateway{Conn: conn, Binding: ms.Binding, Peer: ms.Peer, Certificate: ms.Certificate,
		CertificateNames: ms.CertificateNames, CertificateVerified: ms.CertificateVerified, StandbyBegan: ms.StandbyBegan}
	return &AdoptedStandby{f: f, gw: gw, release: release}, nil
}

// Gateway returns the adopted connection's Gateway, for the caller's logs:
// Conn is the adopted connection, Unwrap and OnOpen are nil.
func (a *AdoptedStandby) Gateway() Gateway { return a.gw }

// Serve serves the adopted connection as Forwarder.Serve does, with
// onOpen as its Gateway.OnOpen: its wait for the first preamble byte, one
// of this Registry's standby connections (Registry.Standby), goes on until
// StandbyTimeout after it began in the other process; it may have ended
// already. (Where this Forwarder has no StandbyTimeout, its client has
// MaxStandbyPerClient waiting already, or its certificate is not verified,
// it has PreambleTimeout, as a connection of this process would.)
func (a *AdoptedStandby) Serve(onOpen func(TunnelInfo)) (Result, error) {
	defer a.release()
	gw := a.gw
	gw.OnOpen = onOpen
	return a.f.Serve(gw)
}

// Discard drops an adopted standby connection that the other process
// kept: this process's descriptors close, the socket and the session stay
// the other process's.
func (a *AdoptedStandby) Discard() { a.release() }

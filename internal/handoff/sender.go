package handoff

import (
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/fdpass"
)

// Fate is what became of an object a Sender offered.
type Fate int

const (
	// Kept: the sender still owns the object and goes on using it.
	Kept Fate = iota
	// Moved: the receiver owns it; the sender closes its copy.
	Moved
)

func (f Fate) String() string {
	if f == Moved {
		return "moved"
	}
	return "kept"
}

// Sender is the old process's end of a handoff session. Its methods are
// not safe for concurrent use: objects move one at a time.
type Sender struct {
	c      *net.UnixConn
	cfg    Config
	peer   Hello
	pidfd  int // the receiver's process (checkPeer)
	nextID uint64
	broken error
}

// Accept accepts the next connection on ln from a process of this user (or
// root) and says hello.
func Accept(ln *net.UnixListener, cfg Config) (*Sender, error) {
	c, err := ln.AcceptUnix()
	if err != nil {
		return nil, fmt.Errorf("handoff: %w", err)
	}
	pidfd, err := checkPeer(c)
	if err != nil {
		c.Close()
		return nil, err
	}
	cfg.Want = ""
	peer, err := hello(c, cfg)
	if err != nil {
		c.Close()
		unix.Close(pidfd)
		return nil, err
	}
	return &Sender{c: c, cfg: cfg, peer: peer, pidfd: pidfd}, nil
}

// Peer is the receiver's hello.
func (s *Sender) Peer() Hello { return s.peer }

// Move offers one object: its kind (the caller's), its state and its
// files, which stay the caller's. It returns Moved once the receiver
// adopted it and was told so: the caller then stops using it and closes
// its files. Kept, with the reason as the error: the receiver refused it
// (a *RefusedError; the session goes on), or the session failed (any
// other error; every later Move returns Kept and ErrBroken at once).
func (s *Sender) Move(kind uint16, state []byte, files ...*os.File) (Fate, error) {
	if s.broken != nil {
		return Kept, fmt.Errorf("%w: %w", ErrBroken, s.broken)
	}
	s.nextID++
	id := s.nextID
	for len(state) > chunk {
		if err := fdpass.Send(s.c, kindMore, state[:chunk]); err != nil {
			return Kept, s.fail(id, err)
		}
		state = state[chunk:]
	}
	item := binary.BigEndian.AppendUint16(nil, kind)
	item = binary.BigEndian.AppendUint64(item, id)
	if err := fdpass.Send(s.c, kindItem, append(item, state...), files...); err != nil {
		return Kept, s.fail(id, err)
	}
	s.c.SetReadDeadline(time.Now().Add(s.cfg.timeout()))
	m, err := fdpass.Receive(s.c, fdpass.Limits{})
	s.c.SetReadDeadline(time.Time{})
	if err != nil {
		return Kept, s.fail(id, fmt.Errorf("waiting for the receiver's answer: %w", err))
	}
	m.Close()
	got, reason, ok := payloadID(m.Payload)
	switch {
	case !ok || got != id:
		return Kept, s.fail(id, fmt.Errorf("the receiver answered for object %d, not %d (kind %d)", got, id, m.Kind))
	case m.Kind == kindRefused:
		return Kept, &RefusedError{Reason: reason}
	case m.Kind != kindAdopted:
		return Kept, s.fail(id, fmt.Errorf("unexpected answer kind %d", m.Kind))
	}
	if err := fdpass.Send(s.c, kindReleased, idPayload(id, "")); err != nil {
		// Not released: the receiver must not start it (it sees the
		// session end while this process lives), and this one goes on.
		return Kept, s.fail(id, err)
	}
	return Moved, nil
}

// fail ends the session keeping object id: the receiver is told so where
// it can be, then the connection closes.
func (s *Sender) fail(id uint64, err error) error {
	s.broken = err
	fdpass.Send(s.c, kindKeep, idPayload(id, err.Error()))
	s.c.Close()
	return fmt.Errorf("handoff: object %d kept: %w", id, err)
}

// Finish tells the receiver that no object follows and waits, up to the
// timeout, for its answer. nil: the receiver has every object moved and
// took the session's outcome over. An error: the session failed, now or
// before; PeerDied then says whether the receiver died with what it took.
func (s *Sender) Finish() error {
	if s.broken != nil {
		return fmt.Errorf("%w: %w", ErrBroken, s.broken)
	}
	s.broken = ErrBroken
	if err := fdpass.Send(s.c, kindDone, nil); err != nil {
		return fmt.Errorf("handoff: the end of the session: %w", err)
	}
	s.c.SetReadDeadline(time.Now().Add(s.cfg.timeout()))
	m, err := fdpass.Receive(s.c, fdpass.Limits{})
	s.c.SetReadDeadline(time.Time{})
	if err != nil {
		return fmt.Errorf("handoff: waiting for the receiver to end the session: %w", err)
	}
	m.Close()
	if m.Kind != kindDone {
		return fmt.Errorf("handoff: the receiver ended the session with message kind %d", m.Kind)
	}
	return nil
}

// PeerDied reports whether the receiver's process has exited, waiting up
// to the timeout for it: for a session that failed, whether what moved
// ended with the receiver (this process may take its state back) or the
// receiver lives on with it.
func (s *Sender) PeerDied() bool { return peerDied(s.pidfd, s.cfg.timeout()) }

// Close ends the session, telling the receiver that no object follows
// unless Finish did or the session failed.
func (s *Sender) Close() error {
	if s.broken == nil {
		s.broken = ErrBroken
		fdpass.Send(s.c, kindDone, nil)
	}
	if s.pidfd >= 0 {
		unix.Close(s.pidfd)
		s.pidfd = -1
	}
	return s.c.Close()
}

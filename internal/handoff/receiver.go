package handoff

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/fdpass"
)

// ErrDone is what Next returns once the sender has no more objects.
var ErrDone = errors.New("handoff: the sender has no more objects")

// Receiver is the new process's end of a handoff session. Its methods are
// not safe for concurrent use.
type Receiver struct {
	c    *net.UnixConn
	cfg  Config
	peer Hello
	// pidfd refers to the sender's process from the connection on, so a
	// recycled PID is never mistaken for it.
	pidfd  int
	broken error
}

// Dial connects to the sender listening at path and says hello.
func Dial(path string, cfg Config) (*Receiver, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("handoff: %w", err)
	}
	pidfd, err := checkPeer(c)
	if err != nil {
		c.Close()
		return nil, err
	}
	peer, err := hello(c, cfg)
	if err != nil {
		c.Close()
		unix.Close(pidfd)
		return nil, err
	}
	return &Receiver{c: c, cfg: cfg, peer: peer, pidfd: pidfd}, nil
}

// Peer is the sender's hello.
func (r *Receiver) Peer() Hello { return r.peer }

// Item is an object offered: the caller builds its object from Kind,
// State and Files (which it owns), without starting it, then calls Adopt,
// or Refuse.
type Item struct {
	Kind  uint16
	State []byte
	Files []*os.File
	id    uint64
	r     *Receiver
}

// Next returns the next object offered, ErrDone when the sender has no
// more, or another error (the session has ended).
func (r *Receiver) Next() (*Item, error) {
	if r.broken != nil {
		return nil, fmt.Errorf("%w: %w", ErrBroken, r.broken)
	}
	var state []byte
	for {
		m, err := fdpass.Receive(r.c, fdpass.Limits{Payload: chunk + 10})
		if err != nil {
			return nil, r.fail(err)
		}
		switch m.Kind {
		case kindMore:
			m.Close()
			if len(state)+len(m.Payload) > MaxState {
				return nil, r.fail(fmt.Errorf("an object's state above %d bytes", MaxState))
			}
			state = append(state, m.Payload...)
			continue
		case kindDone:
			m.Close()
			r.broken = ErrDone
			// The answer tells the sender this process has every
			// object; whether or not it arrives, this one owns them.
			fdpass.Send(r.c, kindDone, nil)
			return nil, ErrDone
		case kindItem:
			if len(m.Payload) < 10 {
				m.Close()
				return nil, r.fail(errors.New("an object without its header"))
			}
			return &Item{
				Kind: binary.BigEndian.Uint16(m.Payload), id: binary.BigEndian.Uint64(m.Payload[2:]),
				State: append(state, m.Payload[10:]...), Files: m.Files, r: r,
			}, nil
		default:
			m.Close()
			return nil, r.fail(fmt.Errorf("unexpected message kind %d", m.Kind))
		}
	}
}

// Adopt tells the sender the object was built, and waits for its verdict,
// as long as it takes: the sender decides within its Timeout, or dies.
// nil: the sender released it: start it. ErrKept: the sender keeps it:
// close the files, never start it. Another error: the session failed and
// the sender lives, so it may still use the object: close it too. The
// Item's files stay the caller's either way.
func (it *Item) Adopt() error {
	r := it.r
	if err := fdpass.Send(r.c, kindAdopted, idPayload(it.id, "")); err != nil {
		// The sender never hears of the adoption: it keeps the object.
		return r.fail(fmt.Errorf("%w: %w", ErrKept, err))
	}
	m, err := fdpass.Receive(r.c, fdpass.Limits{})
	if err != nil {
		// A process that exits with messages unread resets its peer.
		if (errors.Is(err, io.EOF) || errors.Is(err, unix.ECONNRESET)) && r.PeerDied() {
			// The sender died between ADOPTED and RELEASED: its copy
			// is closed with it, this one is the only one left.
			r.fail(fmt.Errorf("the sender (pid %d) died", r.peer.PID))
			return nil
		}
		return r.fail(fmt.Errorf("%w: the session ended before its verdict: %w", ErrKept, err))
	}
	m.Close()
	got, reason, ok := payloadID(m.Payload)
	switch {
	case ok && got == it.id && m.Kind == kindReleased:
		return nil
	case ok && got == it.id && m.Kind == kindKeep:
		return r.fail(fmt.Errorf("%w: %s", ErrKept, reason))
	}
	return r.fail(fmt.Errorf("%w: unexpected message kind %d for object %d", ErrKept, m.Kind, got))
}

// Close closes the item's files: once the object built from them holds
// what it needs (its own duplicates), or to drop them.
func (it *Item) Close() {
	for _, f := range it.Files {
		f.Close()
	}
	it.Files = nil
}

// Refuse tells the sender this process does not take the object (the
// sender keeps it) and closes the item's files.
func (it *Item) Refuse(reason string) error {
	it.Close()
	if err := fdpass.Send(it.r.c, kindRefused, idPayload(it.id, reason)); err != nil {
		return it.r.fail(err)
	}
	return nil
}

// PeerDied reports whether the sender's process has exited, waiting up to
// the timeout for it: for a session that ended, whether the sender's
// objects and state ended with it (this process is the only one left) or
// the sender lives on.
func (r *Receiver) PeerDied() bool { return peerDied(r.pidfd, r.cfg.timeout()) }

// fail ends the session.
func (r *Receiver) fail(err error) error {
	if r.broken == nil {
		r.broken = err
		r.c.Close()
	}
	return fmt.Errorf("handoff: %w", err)
}

// Close ends the session.
func (r *Receiver) Close() error {
	if r.broken == nil {
		r.broken = ErrBroken
	}
	unix.Close(r.pidfd)
	r.pidfd = -1
	return r.c.Close()
}

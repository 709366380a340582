package handoff

import (
	"encoding/binary"
	"fmt"
	"net"
	"sync"
	"syscall"
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

// Sender is the old process's end of a handoff session. Move may be called
// from several goroutines at once: up to Window objects are in flight, each
// waiting for its own answer, and the other calls wait for a turn. Finish
// and Close are called once every Move has returned.
type Sender struct {
	c      *net.UnixConn
	fc     *fdpass.Conn // c, its type checked once
	cfg    Config
	peer   Hello
	pidfd  int           // the receiver's process (checkPeer)
	turns  chan struct{} // a token per object in flight
	window int

	// send serializes the messages of one object (its parts, then its
	// ITEM) and orders RELEASED against fail: once the session failed,
	// no object is released.
	send   sync.Mutex
	nextID uint64
	broken error

	mu      sync.Mutex
	waits   map[uint64]chan answer // the objects offered and not yet answered
	readErr error                  // why read stopped; set before readEnd closes
	done    chan struct{}          // the receiver's DONE arrived
	readEnd chan struct{}          // read has returned
}

// answer is the receiver's answer to one object, or why none came.
type answer struct {
	kind   uint16
	reason string
	err    error
}

// Accept accepts the next connection on ln from a process of this user (or
// root) and says hello.
func Accept(ln *net.UnixListener, cfg Config) (*Sender, error) {
	s, err := accept(ln, cfg)
	if err != nil {
		return nil, err
	}
	go s.read()
	return s, nil
}

// accept is Accept without the reading of the answers.
func accept(ln *net.UnixListener, cfg Config) (*Sender, error) {
	c, err := ln.AcceptUnix()
	if err != nil {
		return nil, fmt.Errorf("handoff: %w", err)
	}
	cfg.Want = ""
	fc, pidfd, peer, err := establish(c, cfg)
	if err != nil {
		return nil, err
	}
	// A receiver that says no window takes one object at a time.
	window := min(cfg.window(), max(peer.Window, 1))
	return &Sender{c: c, fc: fc, cfg: cfg, peer: peer, pidfd: pidfd, window: window, turns: make(chan struct{}, window),
		waits: map[uint64]chan answer{}, done: make(chan struct{}), readEnd: make(chan struct{})}, nil
}

// Peer is the receiver's hello.
func (s *Sender) Peer() Hello { return s.peer }

// Window is how many objects this session has in flight at most: the
// smaller of this side's Config.Window and the receiver's.
func (s *Sender) Window() int { return s.window }

// Move offers one object: its kind (the caller's), its state and its
// files (anything with a descriptor: fdpass.Send), which stay the
// caller's. It returns Moved once the receiver
// adopted it and was told so: the caller then stops using it and closes
// its files. Kept, with the reason as the error: the receiver refused it
// (a *RefusedError; the session goes on), or the session failed (any
// other error; every object in flight and every later Move is Kept, the
// later ones with ErrBroken at once).
func (s *Sender) Move(kind uint16, state []byte, files ...syscall.Conn) (Fate, error) {
	s.turns <- struct{}{}
	defer func() { <-s.turns }()
	id, wait, err := s.offer(kind, state, files)
	if err != nil {
		return Kept, err
	}
	timer := time.NewTimer(s.cfg.timeout())
	defer timer.Stop()
	var a answer
	select {
	case a = <-wait:
	case <-timer.C:
		return Kept, s.fail(id, fmt.Errorf("no answer within %v", s.cfg.timeout()))
	}
	switch {
	case a.err != nil:
		return Kept, s.fail(id, fmt.Errorf("waiting for the receiver's answer: %w", a.err))
	case a.kind == kindRefused:
		return Kept, &RefusedError{Reason: a.reason}
	case a.kind != kindAdopted:
		return Kept, s.fail(id, fmt.Errorf("unexpected answer kind %d", a.kind))
	}
	s.send.Lock()
	defer s.send.Unlock()
	if s.broken != nil {
		// Another object failed the session: this one is not released,
		// and the receiver, which sees KEEP or the session end while this
		// process lives, closes its copy.
		return Kept, fmt.Errorf("handoff: object %d kept: %w: %w", id, ErrBroken, s.broken)
	}
	if err := s.sendLocked(kindReleased, idPayload(id, "")); err != nil {
		// Not released: the receiver must not start it (it sees the
		// session end while this process lives), and this one goes on.
		return Kept, s.failLocked(id, err)
	}
	return Moved, nil
}

// offer sends an object's parts and its ITEM, and returns its ID and where
// its answer arrives.
func (s *Sender) offer(kind uint16, state []byte, files []syscall.Conn) (uint64, chan answer, error) {
	s.send.Lock()
	defer s.send.Unlock()
	if s.broken != nil {
		return 0, nil, fmt.Errorf("%w: %w", ErrBroken, s.broken)
	}
	s.nextID++
	id := s.nextID
	wait := make(chan answer, 1)
	s.mu.Lock()
	if s.readErr != nil {
		wait <- answer{err: s.readErr}
	} else {
		s.waits[id] = wait
	}
	s.mu.Unlock()
	for len(state) > chunk {
		if err := s.sendLocked(kindMore, state[:chunk]); err != nil {
			return 0, nil, s.failLocked(id, err)
		}
		state = state[chunk:]
	}
	item := binary.BigEndian.AppendUint16(nil, kind)
	item = binary.BigEndian.AppendUint64(item, id)
	if err := s.sendLocked(kindItem, append(item, state...), files...); err != nil {
		return 0, nil, s.failLocked(id, err)
	}
	return id, wait, nil
}

// sendLocked sends one message, bounded by the timeout: a receiver that
// stops reading fails the session rather than hold this process. s.send
// is held.
func (s *Sender) sendLocked(kind uint16, payload []byte, files ...syscall.Conn) error {
	s.c.SetWriteDeadline(time.Now().Add(s.cfg.timeout()))
	return s.fc.Send(kind, payload, files...)
}

// read delivers the receiver's answers to the objects waiting for them,
// and its DONE, until the connection ends. It never takes s.send: a Move
// may hold it while its send waits for the receiver, which may itself wait
// for this side to read.
func (s *Sender) read() {
	var err error
	defer func() {
		s.mu.Lock()
		s.readErr = err
		for id, w := range s.waits {
			w <- answer{err: err}
			delete(s.waits, id)
		}
		s.mu.Unlock()
		close(s.readEnd)
	}()
	for {
		var m *fdpass.Message
		if m, err = s.fc.Receive(fdpass.Limits{}); err != nil {
			return
		}
		m.Close()
		if m.Kind == kindDone {
			select {
			case <-s.done:
			default:
				close(s.done)
			}
			continue
		}
		id, reason, ok := payloadID(m.Payload)
		s.mu.Lock()
		w := s.waits[id]
		delete(s.waits, id)
		s.mu.Unlock()
		if !ok || w == nil {
			// Nothing waits for it: the session is in a state this
			// side cannot know. It ends; what was not released stays.
			err = fmt.Errorf("the receiver answered (kind %d) for object %d, which is not waiting for an answer", m.Kind, id)
			s.c.Close()
			return
		}
		w <- answer{kind: m.Kind, reason: reason}
	}
}

// fail ends the session keeping object id and every object not yet
// released: the receiver is told so where it can be, then the connection
// closes.
func (s *Sender) fail(id uint64, err error) error {
	s.send.Lock()
	defer s.send.Unlock()
	return s.failLocked(id, err)
}

func (s *Sender) failLocked(id uint64, err error) error {
	if s.broken == nil {
		s.broken = err
		s.sendLocked(kindKeep, idPayload(id, err.Error()))
		s.c.Close()
	}
	return fmt.Errorf("handoff: object %d kept: %w", id, err)
}

// Finish tells the receiver that no object follows and waits, up to the
// timeout, for its answer. nil: the receiver has every object moved and
// took the session's outcome over. An error: the session failed, now or
// before; PeerDied then says whether the receiver died with what it took.
func (s *Sender) Finish() error {
	s.send.Lock()
	if s.broken != nil {
		defer s.send.Unlock()
		return fmt.Errorf("%w: %w", ErrBroken, s.broken)
	}
	s.broken = ErrBroken
	err := s.sendLocked(kindDone, nil)
	s.send.Unlock()
	if err != nil {
		return fmt.Errorf("handoff: the end of the session: %w", err)
	}
	timer := time.NewTimer(s.cfg.timeout())
	defer timer.Stop()
	select {
	case <-s.done:
		return nil
	case <-s.readEnd:
		select {
		case <-s.done: // DONE, then the receiver closed: read saw both
			return nil
		default:
		}
		return fmt.Errorf("handoff: waiting for the receiver to end the session: %w", s.readErr)
	case <-timer.C:
		return fmt.Errorf("handoff: waiting for the receiver to end the session: no answer within %v", s.cfg.timeout())
	}
}

// PeerDied reports whether the receiver's process has exited, waiting up
// to the timeout for it: for a session that failed, whether what moved
// ended with the receiver (this process may take its state back) or the
// receiver lives on with it.
func (s *Sender) PeerDied() bool { return peerDied(s.pidfd, s.cfg.timeout()) }

// Close ends the session, telling the receiver that no object follows
// unless Finish did or the session failed, and waits for the reading of
// its answers to end.
func (s *Sender) Close() error {
	s.send.Lock()
	if s.broken == nil {
		s.broken = ErrBroken
		s.sendLocked(kindDone, nil)
	}
	s.send.Unlock()
	if s.pidfd >= 0 {
		unix.Close(s.pidfd)
		s.pidfd = -1
	}
	err := s.c.Close()
	<-s.readEnd
	return err
}

package handoff

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/fdpass"
)

// ErrDone is what Next returns once the sender has no more objects.
var ErrDone = errors.New("handoff: the sender has no more objects")

// Receiver is the new process's end of a handoff session. One goroutine
// reads the session (Next, Item.Adopt, Take, Close), and the verdicts of
// objects adopted with AdoptThen are acted on, on it, as it reads them. An
// Item's AdoptThen, Refuse and Close may be called from other goroutines,
// concurrently with the reading and with each other: Take builds several
// objects at once.
type Receiver struct {
	c    *net.UnixConn
	fc   *fdpass.Conn // c, its type checked once
	cfg  Config
	peer Hello
	// pidfd refers to the sender's process from the connection on, so a
	// recycled PID is never mistaken for it.
	pidfd  int
	more   []byte  // the parts of the next ITEM's state
	queued []*Item // offered while Adopt waited for its verdict, for Next

	// mu guards what follows and every message sent, so that an object is
	// registered as adopted before its ADOPTED can be answered, and no
	// answer is sent once the session ended.
	mu      sync.Mutex
	broken  error
	adopted map[uint64]*Item // ADOPTED sent, the sender's verdict not yet read
	// sendErr is the first answer that could not be sent: the reading
	// goroutine ends the session with it (failSendLocked).
	sendErr error
}

// Dial connects to the sender listening at path and says hello.
func Dial(path string, cfg Config) (*Receiver, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, fmt.Errorf("handoff: %w", err)
	}
	fc, pidfd, peer, err := establish(c, cfg)
	if err != nil {
		return nil, err
	}
	return &Receiver{c: c, fc: fc, cfg: cfg, peer: peer, pidfd: pidfd, adopted: map[uint64]*Item{}}, nil
}

// Peer is the sender's hello.
func (r *Receiver) Peer() Hello { return r.peer }

// Item is an object offered: the caller builds its object from Kind,
// State and Files (which it owns), without starting it, then calls Adopt
// or AdoptThen, or Refuse.
type Item struct {
	Kind  uint16
	State []byte
	Files []*os.File
	id    uint64
	r     *Receiver
	// verdict acts on the sender's verdict: nil, start it; else close it.
	verdict func(error)
}

// Next returns the next object offered, ErrDone when the sender has no
// more, or another error (the session has ended). Reading on, it acts on
// the verdicts of the objects adopted with AdoptThen; when it returns
// ErrDone or an error, every one of them has had its verdict.
func (r *Receiver) Next() (*Item, error) {
	if len(r.queued) > 0 {
		it := r.queued[0]
		r.queued = r.queued[1:]
		return it, nil
	}
	for {
		if err := r.brokenErr(); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBroken, err)
		}
		it, err := r.step()
		if err != nil {
			return nil, err
		}
		if it != nil {
			return it, nil
		}
	}
}

// Take reads the session to its end and hands each object offered to
// take, which builds it and answers with AdoptThen or Refuse. Up to the
// receiver's window (Config.Window) of objects, and no more than the
// process has CPUs (GOMAXPROCS), are built at once, each on a goroutine of
// its own, while the session is read on; with one CPU, one at a time on
// the reading goroutine: building is CPU work, and more builders than CPUs
// only make each object wait longer. It returns once the session has
// ended and every take has returned: ErrDone when the sender had no more
// objects, else what ended it. Every object adopted has had its verdict
// by then.
func (r *Receiver) Take(take func(it *Item)) error {
	builders := min(r.cfg.window(), runtime.GOMAXPROCS(0))
	turns := make(chan struct{}, builders)
	var takes sync.WaitGroup
	defer takes.Wait()
	for {
		it, err := r.Next()
		if err != nil {
			return err
		}
		if builders <= 1 {
			take(it)
			continue
		}
		turns <- struct{}{}
		takes.Go(func() {
			defer func() { <-turns }()
			take(it)
		})
	}
}

// step reads one message and acts on it: an ITEM is returned; a verdict is
// given to its object; DONE is answered and ends the session with ErrDone;
// a failure ends it with the error, after every object adopted has had its
// verdict (end).
func (r *Receiver) step() (*Item, error) {
	m, err := r.fc.Receive(fdpass.Limits{Payload: chunk + 10})
	if err != nil {
		r.mu.Lock()
		if r.sendErr != nil && errors.Is(err, os.ErrDeadlineExceeded) {
			// An answer failed, and woke this read (failSendLocked): the
			// session ends with that failure.
			err = r.sendErr
		}
		r.mu.Unlock()
		return nil, r.end(err)
	}
	switch m.Kind {
	case kindMore:
		m.Close()
		if len(r.more)+len(m.Payload) > MaxState {
			return nil, r.end(fmt.Errorf("an object's state above %d bytes", MaxState))
		}
		r.more = append(r.more, m.Payload...)
		return nil, nil
	case kindItem:
		if len(m.Payload) < 10 {
			m.Close()
			return nil, r.end(errors.New("an object without its header"))
		}
		state := append(r.more, m.Payload[10:]...)
		r.more = nil
		return &Item{
			Kind: binary.BigEndian.Uint16(m.Payload), id: binary.BigEndian.Uint64(m.Payload[2:]),
			State: state, Files: m.Files, r: r,
		}, nil
	case kindReleased:
		m.Close()
		id, _, _ := payloadID(m.Payload)
		it := r.takeAdopted(id)
		if it == nil {
			return nil, r.end(fmt.Errorf("RELEASED for object %d, which was not adopted", id))
		}
		it.verdict(nil)
		return nil, nil
	case kindKeep:
		m.Close()
		id, reason, _ := payloadID(m.Payload)
		// The sender ends the session: it keeps every object it has
		// not released, this one's first.
		return nil, r.end(fmt.Errorf("%w (object %d: %s)", ErrKept, id, reason))
	case kindDone:
		m.Close()
		r.mu.Lock()
		if n := len(r.adopted); n > 0 {
			r.mu.Unlock()
			// The sender finishes before its verdicts: it lives, and may
			// use them; they are closed here.
			return nil, r.end(fmt.Errorf("%w: the sender ended the session with %d objects adopted and neither released nor kept", ErrKept, n))
		}
		r.broken = ErrDone
		// The answer tells the sender this process has every object;
		// whether or not it arrives, this one owns them.
		r.fc.Send(kindDone, nil)
		r.mu.Unlock()
		return nil, ErrDone
	}
	m.Close()
	return nil, r.end(fmt.Errorf("unexpected message kind %d", m.Kind))
}

// end ends the session for cause and gives every object adopted and not
// yet released its verdict: what the sender released before it ended is
// started; the rest, when the sender died (its copies closed with it), is
// started too, else closed (KEEP, or the sender lives and may use them:
// never two copies in use). Only the reading goroutine calls it.
func (r *Receiver) end(cause error) error {
	r.mu.Lock()
	if r.broken != nil {
		r.mu.Unlock()
		return fmt.Errorf("handoff: %w", cause)
	}
	// From here no answer is sent: an object built meanwhile is kept by
	// the sender, which never hears of it.
	r.broken = cause
	r.mu.Unlock()
	unread := errors.Is(cause, unix.ECONNRESET) || errors.Is(cause, unix.EPIPE)
	if unread {
		// A socket closed with messages unread in its queue (our
		// answers, as the sender failed with objects in flight) resets
		// its peer: the kernel reports ECONNRESET before the messages
		// the sender queued ahead of its close, which are still read
		// after it. A RELEASED among them decides an object. An answer
		// that found the sender's end closed (EPIPE) left them unread
		// too.
		r.drain()
	}
	// Only a session the sender ended can mean it died; on any other
	// failure this side ends it, and the sender, alive, keeps them.
	ended := unread || errors.Is(cause, io.EOF)
	adopted := r.takeAllAdopted()
	died := ended && len(adopted) > 0 && r.PeerDied()
	for _, it := range adopted {
		switch {
		case died:
			it.verdict(nil)
		case errors.Is(cause, ErrKept):
			it.verdict(cause)
		default:
			it.verdict(fmt.Errorf("%w: the session ended before its verdict: %w", ErrKept, cause))
		}
	}
	for _, it := range r.queued {
		it.Close()
	}
	r.queued = nil
	r.c.Close()
	return fmt.Errorf("handoff: %w", cause)
}

// drain reads what the sender queued before the session ended: the
// verdicts decide their objects; a KEEP ends the draining with the rest
// kept; an object offered and never adopted stays the sender's.
func (r *Receiver) drain() {
	r.c.SetReadDeadline(time.Time{}) // a failed answer's wake-up (failSendLocked) is over
	for {
		m, err := r.fc.Receive(fdpass.Limits{Payload: chunk + 10})
		if errors.Is(err, unix.ECONNRESET) {
			continue
		}
		if err != nil {
			return
		}
		m.Close()
		id, _, _ := payloadID(m.Payload)
		switch m.Kind {
		case kindReleased:
			if it := r.takeAdopted(id); it != nil {
				it.verdict(nil)
			}
		case kindKeep:
			for _, it := range r.takeAllAdopted() {
				it.verdict(fmt.Errorf("%w: the sender failed the session", ErrKept))
			}
			return
		}
	}
}

// Adopt tells the sender the object was built, and waits for its verdict,
// as long as it takes: the sender decides within its Timeout, or dies.
// nil: the sender released it: start it. ErrKept: the sender keeps it:
// close the files, never start it. Another error: the session failed and
// the sender lives, so it may still use the object: close it too. The
// Item's files stay the caller's either way. Objects offered meanwhile
// wait for Next.
func (it *Item) Adopt() error {
	r := it.r
	var verdict error
	settled := false
	if err := it.adopted(func(err error) { verdict, settled = err, true }); err != nil {
		return err
	}
	for !settled {
		next, err := r.step()
		if next != nil {
			r.queued = append(r.queued, next)
		}
		if err != nil && !settled {
			// DONE before the verdict, or a failure: end gave every
			// adopted object its verdict, this one's too.
			return fmt.Errorf("handoff: no verdict: %w", err)
		}
	}
	if verdict != nil {
		return fmt.Errorf("handoff: %w", verdict)
	}
	return nil
}

// AdoptThen tells the sender the object was built and returns: the
// sender's verdict is acted on as a later Next (or Adopt) reads it, or as
// the session ends, by calling start (released, or the sender died) or
// drop (the sender keeps it: close it, never start it), on that
// goroutine. An error: the sender never heard of the adoption and keeps
// the object; neither is called, and the caller drops it.
func (it *Item) AdoptThen(start, drop func()) error {
	return it.adopted(func(err error) {
		if err == nil {
			start()
		} else {
			drop()
		}
	})
}

// adopted registers verdict for the sender's answer and sends ADOPTED.
func (it *Item) adopted(verdict func(error)) error {
	r := it.r
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.stoppedLocked(); err != nil {
		return fmt.Errorf("handoff: %w: %w", ErrKept, err)
	}
	// Registered before it is sent: the RELEASED that answers it may be
	// read at once, on another goroutine.
	it.verdict = verdict
	r.adopted[it.id] = it
	if err := r.fc.Send(kindAdopted, idPayload(it.id, "")); err != nil {
		// The sender never hears of the adoption: it keeps the object.
		delete(r.adopted, it.id)
		err = fmt.Errorf("%w: %w", ErrKept, err)
		r.failSendLocked(err)
		return fmt.Errorf("handoff: %w", err)
	}
	return nil
}

// stoppedLocked says why no answer may be sent: the session ended, or an
// answer failed and the reading goroutine is about to end it; nil while
// answers go out.
func (r *Receiver) stoppedLocked() error { return errors.Join(r.broken, r.sendErr) }

// failSendLocked records an answer that could not be sent and wakes the
// reading goroutine, which ends the session with it (step).
func (r *Receiver) failSendLocked(err error) {
	if r.sendErr == nil {
		r.sendErr = err
		r.c.SetReadDeadline(time.Now())
	}
}

// takeAdopted removes and returns the object adopted as id; nil if none
// is.
func (r *Receiver) takeAdopted(id uint64) *Item {
	r.mu.Lock()
	defer r.mu.Unlock()
	it := r.adopted[id]
	delete(r.adopted, id)
	return it
}

// takeAllAdopted removes and returns every object adopted and without its
// verdict.
func (r *Receiver) takeAllAdopted() map[uint64]*Item {
	r.mu.Lock()
	defer r.mu.Unlock()
	adopted := r.adopted
	r.adopted = map[uint64]*Item{}
	return adopted
}

// brokenErr is what ended the session; nil while it is on.
func (r *Receiver) brokenErr() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.broken
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
	r := it.r
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.stoppedLocked(); err != nil {
		return fmt.Errorf("handoff: %w", err)
	}
	if err := r.fc.Send(kindRefused, idPayload(it.id, reason)); err != nil {
		r.failSendLocked(err)
		return fmt.Errorf("handoff: %w", err)
	}
	return nil
}

// PeerDied reports whether the sender's process has exited, waiting up to
// the timeout for it: for a session that ended, whether the sender's
// objects and state ended with it (this process is the only one left) or
// the sender lives on.
func (r *Receiver) PeerDied() bool { return peerDied(r.pidfd, r.cfg.timeout()) }

// Close ends the session; the objects adopted and without a verdict have
// theirs as the session's end gives it.
func (r *Receiver) Close() error {
	if r.brokenErr() == nil {
		r.end(ErrBroken) // closes the connection
	}
	if r.pidfd >= 0 {
		unix.Close(r.pidfd)
		r.pidfd = -1
	}
	r.c.Close()
	return nil
}

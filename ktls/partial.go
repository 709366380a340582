package ktls

import (
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// partialRecordRetry bounds a reader's wait for a record on a kTLS socket.
// When the bound passes with bytes queued, the reader asks again, and each
// such wait in a row doubles the next bound, up to partialRecordRetryMax;
// with none queued it waits for readability alone.
//
// The kernel surprises here. Its record parser (net/tls/tls_strp.c) leaves
// a record that has not fully arrived in TCP's receive queue, where it is
// charged to the receive buffer with every socket buffer it shares, and
// copies it out to make room only when it finds the receive window
// collapsed or the buffer under pressure (tls_strp_read_copy). It looks
// when data arrives, when a record is consumed and when a reader asks for
// a record; it wakes a reader only for a whole record. The window can
// close after the last look: the ACK that follows the last arrival (the
// delayed one, up to 200 ms later) advertises no window when what is
// queued leaves less than a segment's room. Then nothing can arrive, a
// reader parked for readability is never woken, and the peer probes a
// zero window for good. A reader that finds bytes still queued when its
// bound passes therefore asks again: its read is the parser's look. The
// bound is a timer, not a system call: a read that would block costs no
// more than two deadline changes, and only a wait that outlasts the
// bound asks the socket what it holds (SIOCINQ).
const (
	partialRecordRetry    = 250 * time.Millisecond
	partialRecordRetryMax = 4 * time.Second
)

// rxReader is the kernel socket as its readers' syscall.RawConn (Read,
// SpliceSource): Read bounds the wait for readability
// (partialRecordRetry), with the bound as the socket's read deadline,
// below the caller's (readDeadline).
type rxReader struct {
	syscall.RawConn
	rd *readDeadline
	// mu makes one Read at a time (the socket's read lock would anyway)
	// and guards the call's state.
	mu       sync.Mutex
	f        func(fd uintptr) bool // the caller's, for this Read
	mayBound bool                  // this Read still bounds its waits
	bounded  bool                  // this wait has its bound set
	call     func(fd uintptr) bool // r.read, made once
	inq      func(fd uintptr)      // r.queued's callback, made once
	nInq     int
}

func newRXReader(rd *readDeadline, rc syscall.RawConn) *rxReader {
	r := &rxReader{RawConn: rc, rd: rd}
	r.call = r.read
	r.inq = func(fd uintptr) {
		n, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ)
		if err != nil {
			n = 0
		}
		r.nInq = n
	}
	return r
}

// Read calls f until it returns true, waiting for readability in between
// as syscall.RawConn does. A wait whose bound passes calls f again when
// bytes are queued, and goes on without a bound when none are.
func (r *rxReader) Read(f func(fd uintptr) bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.f, r.mayBound = f, true
	defer func() { r.f = nil }()
	for {
		r.bounded = false
		err := r.RawConn.Read(r.call)
		if !r.bounded {
			if err == nil {
				r.rd.resetRetry()
			}
			return err
		}
		if !r.rd.unbound(err) {
			if err == nil {
				r.rd.resetRetry()
			}
			return err
		}
		if r.queued() {
			r.rd.retries.Add(1)
			stats.partialRecordRetries.Add(1)
		} else {
			r.rd.resetRetry()
			r.mayBound = false
		}
	}
}

// read is the callback under the socket's read lock: f, and when it would
// block, the bound on the wait.
func (r *rxReader) read(fd uintptr) bool {
	if r.f(fd) {
		return true
	}
	if r.mayBound && !r.bounded {
		r.bounded = r.rd.bound()
	}
	return false
}

// queued reports whether TCP holds bytes the kTLS parser has not taken:
// part of a record, when a read found no record ready.
func (r *rxReader) queued() bool {
	r.nInq = 0
	r.RawConn.Control(r.inq)
	return r.nInq > 0
}

// readDeadline is the read deadline of the kernel socket: the caller's
// (SetReadDeadline, SetDeadline), or earlier while a reader's wait for a
// partial record is bounded.
type readDeadline struct {
	mu      sync.Mutex
	sock    *net.TCPConn // the kernel socket once RX runs there; nil before
	caller  time.Time
	bounded bool
	at      time.Time    // the bound, while bounded
	retries atomic.Int32 // waits in a row that ended by their bound with bytes queued
}

// setSock makes sock's waits boundable.
func (d *readDeadline) setSock(sock *net.TCPConn) {
	d.mu.Lock()
	d.sock = sock
	d.mu.Unlock()
}

// set records the caller's deadline t, which set applies to the sockets; a
// bounded wait keeps its bound when that comes first.
func (d *readDeadline) set(t time.Time, set func(time.Time) error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.caller = t
	err := set(t)
	if d.bounded && (t.IsZero() || t.After(d.at)) {
		err = errors.Join(err, d.sock.SetReadDeadline(d.at))
	}
	return err
}

// bound sets the socket's read deadline to the bound of the next wait,
// unless the caller's comes first; false when it did not.
func (d *readDeadline) bound() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sock == nil {
		return false
	}
	wait := min(partialRecordRetry<<min(d.retries.Load(), 8), partialRecordRetryMax)
	at := time.Now().Add(wait)
	if !d.caller.IsZero() && !d.caller.After(at) {
		return false
	}
	if d.sock.SetReadDeadline(at) != nil {
		return false
	}
	d.bounded, d.at = true, at
	return true
}

// unbound ends a bounded wait that ended with err and puts the caller's
// deadline back. It reports whether the wait ended by its bound alone.
func (d *readDeadline) unbound(err error) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.bounded = false
	d.sock.SetReadDeadline(d.caller)
	return errors.Is(err, os.ErrDeadlineExceeded) && (d.caller.IsZero() || time.Now().Before(d.caller))
}

// resetRetry starts the next wait's bound from partialRecordRetry: a read
// found what it waited for, or nothing was queued.
func (d *readDeadline) resetRetry() {
	if d.retries.Load() != 0 {
		d.retries.Store(0)
	}
}

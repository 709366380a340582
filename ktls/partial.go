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

// partialRecordRetry bounds a reader's wait for a record while bytes of one
// are queued on a kTLS socket; each wait in a row that ends by its bound
// doubles it, up to partialRecordRetryMax.
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
// zero window for good. A reader that would block while bytes are queued
// therefore asks again once its bound passes: its read is the parser's
// look.
const (
	partialRecordRetry    = 250 * time.Millisecond
	partialRecordRetryMax = 4 * time.Second
)

// rxReader is the kernel socket as its readers' syscall.RawConn (Read,
// SpliceSource): Read bounds the wait for readability while part of a
// record is queued (partialRecordRetry), with the bound as the socket's
// read deadline, below the caller's (readDeadline).
type rxReader struct {
	syscall.RawConn
	rd *readDeadline
	// mu makes one Read at a time (the socket's read lock would anyway)
	// and guards the call's state.
	mu      sync.Mutex
	f       func(fd uintptr) bool // the caller's, for this Read
	bounded bool                  // this wait has its bound set
	call    func(fd uintptr) bool // r.read, made once
}

func newRXReader(rd *readDeadline, rc syscall.RawConn) *rxReader {
	r := &rxReader{RawConn: rc, rd: rd}
	r.call = r.read
	return r
}

// Read calls f until it returns true, waiting for readability in between
// as syscall.RawConn does; a wait that ends by its partial-record bound
// calls f again.
func (r *rxReader) Read(f func(fd uintptr) bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.f = f
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
			return err
		}
		stats.partialRecordRetries.Add(1)
	}
}

// read is the callback under the socket's read lock: f, and when it would
// block with bytes queued, the bound on the wait.
func (r *rxReader) read(fd uintptr) bool {
	if r.f(fd) {
		return true
	}
	if !r.bounded && queued(fd) {
		r.bounded = r.rd.bound()
	}
	return false
}

// queued reports whether TCP holds bytes the kTLS parser has not taken:
// part of a record, when a read found no record ready.
func queued(fd uintptr) bool {
	n, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ)
	return err == nil && n > 0
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
	retries atomic.Int32 // waits in a row that ended by their bound
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
// deadline back. It reports whether the wait ended by its bound alone: the
// reader asks again.
func (d *readDeadline) unbound(err error) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.bounded = false
	d.sock.SetReadDeadline(d.caller)
	if !errors.Is(err, os.ErrDeadlineExceeded) || (!d.caller.IsZero() && !time.Now().Before(d.caller)) {
		d.retries.Store(0)
		return false
	}
	d.retries.Add(1)
	return true
}

// resetRetry starts the next wait's bound from partialRecordRetry: a read
// found what it waited for.
func (d *readDeadline) resetRetry() {
	if d.retries.Load() != 0 {
		d.retries.Store(0)
	}
}

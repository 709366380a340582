package ktls

import (
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"weak"

	"golang.org/x/sys/unix"
)

// A read of a kernel RX socket that has waited partialRecordRetry for a
// record while bytes are queued is woken to ask again; each such wake in a
// row doubles the wait before the next, up to partialRecordRetryMax.
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
// zero window for good. Woken, the reader's read is the parser's look.
//
// A sweep every sweepTick watches every reader, so a read costs two
// atomic additions: no timer, no system call, and no frame deeper on the
// stack of a relay's goroutine, which parks already deep (a relay that
// waits on SpliceSource's RawConn marks its waits with BeginWait and
// EndWait). It asks a socket what it holds (SIOCINQ) once per read that
// outlasts partialRecordRetry, and wakes the reader through the socket's
// read deadline.
const (
	partialRecordRetry    = 250 * time.Millisecond
	partialRecordRetryMax = 4 * time.Second
	sweepTick             = partialRecordRetry / 2
)

// rxReader watches the waits of the kernel socket's readers: its Read is
// the RawConn's that Conn.Read reads through, and a relay that splices
// from the RawConn of SpliceSource marks its waits with Conn.BeginWait and
// Conn.EndWait.
type rxReader struct {
	syscall.RawConn
	rd *readDeadline
	// mu makes one Read at a time (the socket's read lock would anyway).
	mu sync.Mutex
	// seq is odd while a Read waits in RawConn.Read; each wait has its own.
	seq atomic.Uint64
	// retries: wakes in a row that found no record.
	retries atomic.Int32
	// The sweeper's own: the seq it saw at its last sweep, the sweeps in
	// a row that saw it, the seq whose queue it found empty, and whether
	// the socket was found closed (dropped at the next sweep).
	seen, checked uint64
	sweeps        int
	closed        bool
}

// dueSweeps is how many sweeps a wait lasts before it is looked at:
// partialRecordRetry, doubled for each wake in a row before it, up to
// partialRecordRetryMax.
func (r *rxReader) dueSweeps() int {
	return int(min(partialRecordRetry<<min(r.retries.Load(), 8), partialRecordRetryMax) / sweepTick)
}

func newRXReader(rd *readDeadline, rc syscall.RawConn) *rxReader {
	r := &rxReader{RawConn: rc, rd: rd}
	watched.add(r)
	return r
}

// Read calls f until it returns true, waiting for readability in between
// as syscall.RawConn does; a wait the sweeper ends calls f again.
func (r *rxReader) Read(f func(fd uintptr) bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		r.begin()
		err := r.RawConn.Read(f)
		if r.end(err) {
			continue
		}
		return err
	}
}

// begin marks the start of a wait on the socket, which the sweeper watches.
func (r *rxReader) begin() { r.seq.Add(1) }

// end marks the end of the wait begun, which ended with err. It reports
// whether the sweeper ended it, to ask the kernel again.
func (r *rxReader) end(err error) (again bool) {
	r.seq.Add(1)
	if r.rd.poked.Load() && r.rd.unpoke(err) {
		r.retries.Add(1)
		stats.partialRecordRetries.Add(1)
		return true
	}
	if err == nil && r.retries.Load() != 0 {
		r.retries.Store(0)
	}
	return false
}

// queued reports whether TCP holds bytes the kTLS parser has not taken:
// part of a record, while a read finds no record ready. False for a
// closed socket.
func (r *rxReader) queued() (queued, open bool) {
	var n int
	var err error
	if r.RawConn.Control(func(fd uintptr) { n, err = unix.IoctlGetInt(int(fd), unix.SIOCINQ) }) != nil {
		return false, false
	}
	return err == nil && n > 0, true
}

// watched holds every rxReader, weakly: a Conn dropped without Close
// leaves it with the garbage collector.
var watched watchList

type watchList struct {
	mu      sync.Mutex
	readers []weak.Pointer[rxReader]
	running bool
	rounds  int // sweeps made
}

// openCheckEvery: every that many sweeps, the readers not waiting are
// checked for a closed socket too.
const openCheckEvery = 8

func (w *watchList) add(r *rxReader) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.readers = append(w.readers, weak.Make(r))
	if !w.running {
		w.running = true
		time.AfterFunc(sweepTick, w.sweeper)
	}
}

// sweeper sweeps every sweepTick while a reader is watched, each time on a
// goroutine of its own: none waits between sweeps.
func (w *watchList) sweeper() {
	if w.sweep() {
		time.AfterFunc(sweepTick, w.sweeper)
	}
}

// sweep wakes each reader whose wait has lasted its bound with bytes
// queued, and drops the readers of closed sockets. It returns false, the
// sweeps ending, when none is left.
func (w *watchList) sweep() bool {
	w.mu.Lock()
	w.rounds++
	checkIdle := w.rounds%openCheckEvery == 0
	var due, idle []*rxReader
	live := w.readers[:0]
	for _, p := range w.readers {
		r := p.Value()
		if r == nil || r.closed {
			continue
		}
		s := r.seq.Load()
		if s%2 == 0 || s != r.seen {
			r.seen, r.sweeps = s, 0
			if checkIdle {
				idle = append(idle, r)
			}
		} else if r.sweeps++; r.checked != s && r.sweeps >= r.dueSweeps() {
			due = append(due, r)
		}
		live = append(live, p)
	}
	clear(w.readers[len(live):])
	w.readers = live
	w.mu.Unlock()
	for _, r := range due {
		queued, open := r.queued()
		switch {
		case !open:
			r.closed = true
		case queued:
			r.rd.poke(r, r.seen)
		default:
			r.checked = r.seen
		}
	}
	for _, r := range idle {
		r.closed = r.RawConn.Control(func(uintptr) {}) != nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.readers) == 0 {
		w.running = false
		return false
	}
	return true
}

// readDeadline is the read deadline of the kernel socket: the caller's
// (SetReadDeadline, SetDeadline), or past while the sweeper wakes a
// reader (poked).
type readDeadline struct {
	mu     sync.Mutex
	sock   *net.TCPConn // the kernel socket once RX runs there; nil before
	caller time.Time
	poked  atomic.Bool
}

// setSock makes sock's readers wakeable.
func (d *readDeadline) setSock(sock *net.TCPConn) {
	d.mu.Lock()
	d.sock = sock
	d.mu.Unlock()
}

// set records the caller's deadline t, which set applies to the sockets; a
// wake in progress stays in force.
func (d *readDeadline) set(t time.Time, set func(time.Time) error) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.caller = t
	err := set(t)
	if d.poked.Load() {
		err = errors.Join(err, d.sock.SetReadDeadline(pastDeadline))
	}
	return err
}

// pastDeadline wakes a reader at once.
var pastDeadline = time.Unix(1, 0)

// poke wakes r's read number seq, if it still waits, by a past deadline.
func (d *readDeadline) poke(r *rxReader, seq uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sock == nil || r.seq.Load() != seq {
		return
	}
	d.poked.Store(true)
	d.sock.SetReadDeadline(pastDeadline)
}

// unpoke ends a wake and puts the caller's deadline back. It reports
// whether the read that ended with err ended by the wake alone: the
// caller's deadline has not passed.
func (d *readDeadline) unpoke(err error) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.poked.Load() {
		return false
	}
	d.poked.Store(false)
	d.sock.SetReadDeadline(d.caller)
	return errors.Is(err, os.ErrDeadlineExceeded) && (d.caller.IsZero() || time.Now().Before(d.caller))
}

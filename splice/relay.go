// Package splice is the data path of caddy-ktls: a bidirectional relay
// between two connections that moves bytes with splice(2) through a kernel
// pipe (socket → pipe → socket, never through userspace) wherever both ends
// of a direction are kernel sockets carrying plaintext: a plain TCP socket,
// or a kTLS socket whose receive (source) or send (sink) side runs in the
// kernel. A direction that cannot be spliced falls back to a buffered copy
// with the same semantics and metering.
//
// The relay is driven by Go's netpoller: splice(2) runs non-blocking inside
// syscall.RawConn callbacks (as in Go's internal/poll/splice_linux.go), so a
// waiting tunnel parks a goroutine, never an OS thread. Pipes come from a
// PipePool per transfer burst: a direction takes a pipe when its source turns
// readable, splices until the source would block with the pipe drained into
// the sink, and gives the pipe back. An idle tunnel holds no pipe. (The copy
// path cannot wait for readability without a buffer, because a userspace TLS
// source may hold decrypted bytes no socket readiness would announce: a
// copying direction holds one pooled 32 KiB buffer while blocked in Read.)
// When no pipe can be opened because the process or the system is out of
// file descriptors (EMFILE, ENFILE), that burst is copied through userspace
// instead, and counted (DirectionStats.PipeShortages): a tunnel that is
// moving bytes does not fail for want of a pipe.
//
// Pipes ask for DefaultPipeSize (F_SETPIPE_SZ); where the kernel refuses,
// they keep its default capacity and a burst takes more calls. Every splice
// call passes SPLICE_F_MOVE|SPLICE_F_NONBLOCK and deliberately never
// SPLICE_F_MORE: the sink would see it as MSG_MORE, and a kTLS socket then
// holds its record open (a TCP socket its segment) for a next write that a
// quiet source may never make; a call that drains a full pipe already yields
// full records.
//
// A kTLS connection must have finished its handshake before it is given to
// a Relay: its SpliceSource/SpliceSink answer ok only after the offload.
//
// kTLS sources deliver TLS control records (alerts, KeyUpdate) out of band:
// splice(2) cannot read them and fails (EINVAL at a non-data record,
// EKEYEXPIRED after a KeyUpdate until the new key is installed, EIO, older
// kernels ENOTSUPP). The relay then calls the connection's Read once, which
// handles that record in userspace (and may return data behind it), and
// resumes splicing. EBADMSG is not one of them: the kernel failed to
// authenticate a record and has already aborted the connection, so the
// tunnel ends there (a Read would only fail on the same record again). The
// contract is the Source interface, implemented by *ktls.Conn; this package
// does not import ktls.
//
// A running Relay can stop and be continued by another, in this process or
// one the sockets are passed to (an upgrade that keeps its tunnels): Pause
// stops both directions at a safe point, where neither holds a byte in this
// process, and Run returns ErrPaused with both connections open. A
// direction parked for readability stops at once; one whose sink does not
// take the rest of its pipe hands the pipe over (its read end, in
// Paused.Pipes, and its byte count, in the state), never drops it. A
// direction on the copy path that holds bytes it read and has not written
// makes Pause refuse (PauseBuffered), and the relay goes on unharmed.
// Resume builds the next Relay from the connections, the pipes and the
// PauseState (which encodes as versioned JSON, descriptors apart): its
// counters go on from the paused relay's, an ended direction stays ended,
// and a pipe's bytes reach their sink before anything else in their
// direction.
package splice

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
)

// Source is implemented by connections whose receive side may be in the
// kernel (*ktls.Conn). SpliceSource returns the socket and ok=true only when
// splice(2) from it yields the connection's plaintext (kTLS RX in the
// kernel). When splice(2) from that socket fails, the connection's Read is
// called once to handle the pending control record in userspace: it returns
// the record's data bytes if any, (0, nil) after a KeyUpdate, io.EOF on
// close_notify, or an error (an alert, a decryption failure). It may go on
// to read data behind the control record, but must return all it took off
// the socket: the relay resumes splicing straight after it, and its buffer
// (32 KiB) holds more than one TLS record's plaintext (at most 16 KiB).
type Source interface {
	SpliceSource() (rc syscall.RawConn, ok bool)
}

// Sink is implemented by connections whose send side may be in the kernel
// (*ktls.Conn). SpliceSink returns the socket and ok=true only when bytes
// spliced into it are sent as the connection's plaintext (kTLS TX in the
// kernel seals them into records).
type Sink interface {
	SpliceSink() (rc syscall.RawConn, ok bool)
}

// Sealer is implemented by sinks whose kernel seals what is spliced into
// them under a key that wears out (*ktls.Conn). The relay brackets each
// splice(2) into the sink with BeginSeal and EndSeal (with what the call
// moved): between the two no other write reaches the socket, so a key
// update never falls inside the call, and BeginSeal may renew the key
// first. BeginSeal runs inside the socket's write callback (fd is the
// socket): it must not block, and unix.EAGAIN makes the relay wait until
// the socket takes writes and call it again. Another error ends the
// direction as failed. EndSeal is called only after a nil BeginSeal.
type Sealer interface {
	BeginSeal(fd uintptr) error
	EndSeal(n int64)
}

// Waiter is implemented by sources whose waits the relay marks
// (*ktls.Conn): BeginWait before it waits on SpliceSource's RawConn,
// EndWait with what that wait returned. EndWait returns true when the
// source ended the wait itself, to have the relay ask the kernel again
// (a partial record behind a closed receive window: ktls's partial.go).
type Waiter interface {
	BeginWait()
	EndWait(err error) (again bool)
}

// Opener is implemented by sources whose kernel opens records under the
// peer's key, which wears out (*ktls.Conn). The relay reports every
// splice(2) from the source to Opened with what it moved; an error ends
// the direction as failed.
type Opener interface {
	Opened(n int64) error
}

// Aborter is implemented by connections that can end as a failure in a way
// their peer cannot mistake for an orderly end (*ktls.Conn: a fatal TLS
// alert after what was sent, or a reset). A tunnel that fails ends each side
// whose incoming direction did not end in order this way; any other
// connection gets a TCP reset (SO_LINGER 0) on the socket under it.
type Aborter interface {
	Abort() error
}

// CloseNotifier is implemented by connections whose orderly end is a
// message before the transport's end (*ktls.Conn: TLS close_notify).
// CloseNotified reports, once the connection's Read (or splice(2) from it)
// has ended, whether that message came; false means the stream was cut
// (the peer's FIN alone, or a reset the kernel reported as an end).
type CloseNotifier interface {
	CloseNotified() bool
}

// ErrTruncated ends a direction whose source ended without the close_notify
// Options.RequireCloseNotify asks of it.
var ErrTruncated = errors.New("the peer ended the stream without close_notify: truncated")

// Refuser is implemented by connections that can tell their peer that what
// it asked for was refused, distinctly from a failure (*ktls.Conn: the fatal
// alert access_denied, where Abort sends internal_error).
type Refuser interface {
	Refuse() error
}

// closeWriter is the half-close contract: *net.TCPConn (shutdown(SHUT_WR))
// and *ktls.Conn (close_notify, then SHUT_WR).
type closeWriter interface {
	CloseWrite() error
}

// Direction names one half of a tunnel.
type Direction uint8

const (
	AToB Direction = iota // bytes read from a, written to b
	BToA                  // bytes read from b, written to a
)

// String returns "a->b" or "b->a".
func (d Direction) String() string {
	if d == AToB {
		return "a->b"
	}
	return "b->a"
}

// EndReason says why a direction stopped.
type EndReason uint32

const (
	EndRunning  EndReason = iota // still relaying
	EndEOF                       // the source ended (FIN or close_notify) and the sink was half-closed
	EndError                     // reading the source or writing the sink failed; DirectionStats.Err says how
	EndAborted                   // stopped because the other direction failed (or ended, with Options.CloseOnEOF)
	EndCanceled                  // stopped because the context was canceled
	EndPaused                    // stopped at a safe point by Pause; the connections are untouched
)

// String returns the reason as a short lowercase word.
func (r EndReason) String() string {
	switch r {
	case EndRunning:
		return "running"
	case EndEOF:
		return "eof"
	case EndError:
		return "error"
	case EndAborted:
		return "aborted"
	case EndCanceled:
		return "canceled"
	case EndPaused:
		return "paused"
	}
	return fmt.Sprintf("EndReason(%d)", uint32(r))
}

// Options configure a tunnel. The zero value is ready to use.
type Options struct {
	// Pipes supplies pipes for spliced bursts; nil means DefaultPipePool().
	Pipes *PipePool
	// OnBytes, when set, is called after every step that delivered bytes
	// to a sink (each splice(2) into the sink, each userspace write) with
	// the step's byte count. It runs on the relay's goroutines, so it must be
	// cheap and must not block: it is meant for activity metering.
	OnBytes func(dir Direction, n int)
	// CloseOnEOF ends the whole tunnel when either source ends, instead of
	// half-closing the other side and letting the other direction finish.
	// A sink without CloseWrite always behaves this way.
	CloseOnEOF bool
	// Refused, when set, says whether a direction's error is its source's
	// refusal (a sandbox forwarder's access_denied: nothing it was asked for
	// reached anyone). When a direction fails that way before it delivered
	// a byte, its sink is ended with Refuse (Refuser, else as a failure)
	// instead of Abort, so that the refusal travels on to the peer that
	// asked: an edge gateway's user learns that nothing reached the sandbox.
	Refused func(error) bool
	// RequireCloseNotify, for a direction, makes its source's end an orderly
	// end only when the source says it ended with close_notify
	// (CloseNotifier): an end without it fails the direction with
	// ErrTruncated, so the other side is ended as a failure, never
	// half-closed as if the stream were complete. For a source whose peer
	// always ends with close_notify, as both sides of a sandbox tunnel do:
	// there a bare end is a peer that died, or a reset that the kernel
	// reported as an end of stream. A source that is no CloseNotifier
	// ends as before.
	RequireCloseNotify [2]bool
	// Limit, when set for a direction, bounds its rate: each splice(2) from
	// the source (or read, on the copy path) asks for no more than the
	// Limiter grants, and the direction waits while it grants nothing,
	// with the bytes left in the source's kernel socket: the spliced path
	// stays zero-copy. The time spent waiting is DirectionStats.Throttled.
	// Nil (the default) costs one comparison per step.
	Limit [2]Limiter
}

// DirectionStats are one direction's counters. Bytes is exact: it is updated
// after every splice(2) or write into the sink. Once the direction has ended
// it equals SpliceBytes + CopyBytes (a snapshot taken while it runs may see
// the three counters one step apart).
type DirectionStats struct {
	Bytes          int64         // bytes delivered to the sink
	SpliceBytes    int64         // of which moved by splice(2)
	CopyBytes      int64         // of which copied through userspace (fallback, control-record data)
	ControlRecords int64         // splice(2) failures handed to the source's Read (kTLS control records)
	PipeShortages  int64         // bursts copied through userspace because no pipe could be opened (EMFILE, ENFILE)
	Spliced        bool          // the direction runs on the splice path
	Throttled      time.Duration // time spent waiting for its Limiter (Options.Limit)
	End            EndReason     // EndRunning while the direction runs
	Err            error         // set when End is EndError
}

// Stats holds both directions' counters.
type Stats struct {
	AToB, BToA DirectionStats
}

// Dir returns the counters of direction d.
func (r Stats) Dir(d Direction) DirectionStats {
	if d == AToB {
		return r.AToB
	}
	return r.BToA
}

// maxRecordPlaintext is the most a TLS record carries (2^14 bytes): what
// one splice(2) from a kTLS socket returns while records are full.
const maxRecordPlaintext = 1 << 14

// recordBatch bounds how much a kTLS source's records are gathered in the
// pipe before it is drained (see spliceLoop): 16 full records, so a drain
// per 16 records instead of one each, while the first of them waits for at
// most 15 more records' decryption.
const recordBatch = 16 * maxRecordPlaintext

// maxSealPerCall bounds what one splice(2) into a kTLS sink carries: the
// kernel seals it into records inside the call, which keeps its P (see
// spliceSyscall), so one call is kept to about a read batch's work.
const maxSealPerCall = recordBatch

// spliceFunc is splice(2) between two file descriptors without offsets.
type spliceFunc func(rfd, wfd, n, flags int) (int64, error)

// spliceSyscall enters splice(2) with RawSyscall6, which, unlike
// unix.Splice, does not tell the scheduler, so the goroutine keeps its P
// through the call. Every call here is non-blocking (the sockets are, and
// SPLICE_F_NONBLOCK covers the pipe): its time is the kernel working on one
// bounded batch (opening a record, sealing up to maxSealPerCall, moving
// page references), CPU this thread spends either way; it can sleep only
// on a socket lock that the other direction holds for its own bounded call.
// A syscall the scheduler knows of that outlasts sysmon's 20 µs tick has
// its P taken when no other P is idle (a busy host, or one CPU): another
// thread is woken to run it, finds nothing to do and parks again, and the
// call, returning, must win a P back; sysmon also polls every 20 µs for
// such calls. A splice(2) that opens or seals records can outlast that
// tick (one record's crypto does on a slow CPU), and the hand-offs and the
// polling then cost about as many syscalls as the data path itself
// (figures: docs/bench/relay.md). Go's runtime developers make the same
// case for long non-blocking calls (golang/go#29734). The price: a
// stop-the-world waits for the call to end, which recordBatch and
// maxSealPerCall keep short.
func spliceSyscall(rfd, wfd, n, flags int) (int64, error) {
	r, _, errno := unix.RawSyscall6(unix.SYS_SPLICE, uintptr(rfd), 0, uintptr(wfd), 0, uintptr(n), uintptr(flags))
	if errno != 0 {
		return 0, errno
	}
	return int64(r), nil
}

// spliceFlags: SPLICE_F_MOVE is a hint, SPLICE_F_NONBLOCK keeps the pipe side
// from blocking (the socket side is non-blocking already). SPLICE_F_MORE is
// deliberately not set: it becomes MSG_MORE on the sink, and a kTLS sink then
// keeps its TLS record open, a TCP sink its segment corked, until the next
// write, which may never come when the source goes quiet. Within one call the
// kernel already marks all but the last pipe buffer "more", so one call
// draining a full pipe still produces full records.
const spliceFlags = unix.SPLICE_F_MOVE | unix.SPLICE_F_NONBLOCK

// maxControlRecordsInARow bounds consecutive splice(2) failures handed to the
// source's Read without a spliced byte in between. A well-behaved kTLS
// connection consumes one control record per Read (and rate-limits KeyUpdate
// itself); a source that keeps failing splice without progress would
// otherwise spin a CPU forever.
const maxControlRecordsInARow = 256

// copyBufferSize is the userspace buffer of the copy path and of control
// records: enough for a whole TLS record (16 KiB plaintext) plus headroom.
const copyBufferSize = 32 << 10

var copyBuffers = sync.Pool{New: func() any { b := make([]byte, copyBufferSize); return &b }}

// A Relay relays bytes between two connections in both directions. Make one
// with New, start it with Run, and read its live counters with Stats from any
// goroutine while it runs.
//
// Ownership: a Relay owns both connections once Run is called. It closes
// both before Run returns, whatever the outcome but a Pause, and sets their
// deadlines to stop the relay early (context canceled, a failed direction,
// a Pause); callers must not use the connections meanwhile.
type Relay struct {
	conns  [2]net.Conn
	opts   Options
	pipes  *PipePool
	splice spliceFunc

	dirs    [2]dirState
	started atomic.Bool

	abortOnce   sync.Once
	abortReason atomic.Uint32 // EndReason given to directions stopped by abort
	aborted     chan struct{} // closed by abort: wakes a throttled direction
	// peerGone aborts the tunnel peerGoneGrace after a direction found its
	// sink's peer gone, unless Run has ended by then (see finish).
	peerGone atomic.Pointer[time.Timer]

	// deadlineMu orders abort's and Pause's deadline changes: once paused,
	// abort leaves the deadlines alone; once aborted, Pause cannot clear them.
	deadlineMu sync.Mutex
	paused     bool // a Pause committed (under deadlineMu)
	// pauseMu guards the pause handshake (pause.go).
	pauseMu   sync.Mutex
	pauseReq  *pauseRequest    // the Pause in progress, nil when none
	pauseWake chan struct{}    // closed when the next Pause starts: wakes throttled directions
	exited    [2]bool          // direction d has returned
	exitedCh  [2]chan struct{} // closed when direction d returns
	// pending[d] is the pipe a resumed direction delivers to its sink
	// before it reads its source (Resume).
	pending [2]*pipe
}

// peerGoneGrace bounds how long the other direction may go on delivering
// what a vanished peer sent before it went (see finish).
const peerGoneGrace = 5 * time.Second

// sinkError is a direction's failure to write its sink.
type sinkError struct{ error }

func (e sinkError) Unwrap() error { return e.error }

// sinkPeerGone reports whether err says that the sink's peer is gone: it
// reset the connection, or closed it with our bytes unread.
func sinkPeerGone(err error) bool {
	var se sinkError
	return errors.As(err, &se) && (errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET))
}

// sinkClosedUnder reports whether err says that the sink was closed under
// the direction by the connection itself: a ktls.Conn closes its socket
// when its reader meets a fatal error (the peer's alert), so the other
// direction, which reads that connection, is about to report the cause.
func sinkClosedUnder(err error) bool {
	var se sinkError
	return errors.As(err, &se) && errors.Is(err, net.ErrClosed)
}

type dirState struct {
	bytes, spliceBytes, copyBytes, controlRecords, pipeShortages, throttled atomic.Int64
	spliced                                                                 atomic.Bool
	end                                                                     atomic.Uint32
	// sinkClosing is set just before this direction half-closes its sink,
	// whose FIN makes a later TCP_CLOSE on that socket an orderly end.
	sinkClosing atomic.Bool
	mu          sync.Mutex
	err         error
}

// New returns a tunnel between a and b; nothing moves until Run.
//
// A direction is spliced when its source is a Source that says ok, or a
// *net.TCPConn, and its sink is a Sink that says ok, or a *net.TCPConn. Any
// other connection (a userspace TLS conn, a wrapper that may buffer bytes)
// is read and written through its net.Conn methods.
func New(a, b net.Conn, opts Options) *Relay {
	return newRelay(a, b, opts, spliceSyscall)
}

func newRelay(a, b net.Conn, opts Options, splice spliceFunc) *Relay {
	t := &Relay{conns: [2]net.Conn{a, b}, opts: opts, pipes: opts.Pipes, splice: splice, aborted: make(chan struct{}), pauseWake: make(chan struct{})}
	t.exitedCh = [2]chan struct{}{make(chan struct{}), make(chan struct{})}
	if t.pipes == nil {
		t.pipes = defaultPipes
	}
	return t
}

// Run relays between a and b until both directions end, then closes both:
// see Relay.Run.
func Run(ctx context.Context, a, b net.Conn, opts Options) (Stats, error) {
	return New(a, b, opts).Run(ctx)
}

// Run relays until both directions have ended, closes both connections and
// returns the final counters. A source's EOF half-closes the other side and
// the other direction keeps going; a failure in either direction stops both,
// except that when a sink's peer is gone (EPIPE, ECONNRESET) the other
// direction first delivers what that peer sent before it went, for up to
// peerGoneGrace.
// A tunnel that ends in error or is canceled tells its peers so: each
// connection whose incoming direction did not end with an orderly EOF is
// aborted (Aborter, else a TCP reset) instead of closed, so neither peer
// takes a cut stream for a complete one; a side that already got its
// orderly end (close_notify or FIN after every byte) is closed as usual.
// The error is nil when both directions ended with EOF (or, with CloseOnEOF,
// one did); otherwise it names the failed direction, or wraps the context's
// cause when ctx was canceled. After a Pause that succeeded, Run returns
// ErrPaused and the counters at the pause, and leaves both connections
// open, with no deadline set, for the caller. Run may be called once.
func (t *Relay) Run(ctx context.Context) (Stats, error) {
	if !t.started.CompareAndSwap(false, true) {
		return t.Stats(), errors.New("splice: Relay.Run called twice")
	}
	if t.conns[0] == nil || t.conns[1] == nil {
		return Stats{}, errors.New("splice: Relay needs two connections, got a nil one")
	}
	stop := context.AfterFunc(ctx, func() { t.abort(EndCanceled) })
	var wg sync.WaitGroup
	wg.Go(func() { t.runDirection(BToA) })
	t.runDirection(AToB)
	wg.Wait()
	stop()
	if grace := t.peerGone.Load(); grace != nil {
		grace.Stop()
	}
	res := t.Stats()
	t.deadlineMu.Lock()
	paused := t.paused
	t.deadlineMu.Unlock()
	if paused {
		return res, ErrPaused
	}
	err := t.resultErr(ctx, res)
	for i, c := range t.conns {
		// Connection i is the sink of direction 1-i.
		in := res.Dir(Direction(1 - i))
		switch {
		case err == nil || in.End == EndEOF:
			c.Close()
		case t.refused(in):
			Refuse(c)
		default:
			Abort(c)
		}
	}
	return res, err
}

// refused reports whether ds, a direction that ended, failed with its
// source's refusal (Options.Refused) before it delivered a byte.
func (t *Relay) refused(ds DirectionStats) bool {
	return t.opts.Refused != nil && ds.End == EndError && ds.Bytes == 0 && t.opts.Refused(ds.Err)
}

// Refuse closes c as refused: c's own Refuse where it has one (Refuser),
// else as a failure (Abort).
func Refuse(c net.Conn) {
	if r, ok := c.(Refuser); ok {
		r.Refuse()
		return
	}
	Abort(c)
}

// Abort closes c as a failure, as a failed tunnel closes its sides: c's own
// Abort where it has one (Aborter), else a reset on the TCP socket under c
// (reached through NetConn, as *tls.Conn offers it), closed before c itself
// so that a layer's own goodbye (crypto/tls's close_notify) cannot reach
// the peer ahead of the reset. Without a TCP socket it is Close.
func Abort(c net.Conn) {
	if a, ok := c.(Aborter); ok {
		a.Abort()
		return
	}
	if tc := sockerr.TCPConn(c); tc != nil {
		tc.SetLinger(0)
		tc.Close()
	}
	c.Close()
}

func (t *Relay) resultErr(ctx context.Context, res Stats) error {
	// A sink closed under a direction is the other direction's failure,
	// which names the cause.
	for _, d := range []Direction{AToB, BToA} {
		if ds, other := res.Dir(d), res.Dir(1-d); ds.End == EndError && !(sinkClosedUnder(ds.Err) && other.End == EndError) {
			return fmt.Errorf("splice: %s: %w", d, ds.Err)
		}
	}
	if res.AToB.End == EndCanceled || res.BToA.End == EndCanceled {
		return fmt.Errorf("splice: relay canceled: %w", context.Cause(ctx))
	}
	return nil
}

// Stats returns a snapshot of the counters; safe to call while Run runs.
func (t *Relay) Stats() Stats {
	return Stats{AToB: t.dirs[AToB].snapshot(), BToA: t.dirs[BToA].snapshot()}
}

func (s *dirState) snapshot() DirectionStats {
	s.mu.Lock()
	err := s.err
	s.mu.Unlock()
	return DirectionStats{
		Bytes:          s.bytes.Load(),
		SpliceBytes:    s.spliceBytes.Load(),
		CopyBytes:      s.copyBytes.Load(),
		ControlRecords: s.controlRecords.Load(),
		PipeShortages:  s.pipeShortages.Load(),
		Spliced:        s.spliced.Load(),
		Throttled:      time.Duration(s.throttled.Load()),
		End:            EndReason(s.end.Load()),
		Err:            err,
	}
}

// abort stops both directions by moving the connections' deadlines into the
// past, which wakes goroutines parked in the netpoller (and blocked Reads)
// with os.ErrDeadlineExceeded. The connections stay open until Run closes
// them, so no file descriptor is reused under a running splice(2).
func (t *Relay) abort(reason EndReason) {
	t.abortOnce.Do(func() {
		t.abortReason.Store(uint32(reason))
		close(t.aborted)
		t.deadlineMu.Lock()
		defer t.deadlineMu.Unlock()
		if !t.paused {
			t.setDeadlines(pastDeadline)
		}
	})
}

// pastDeadline wakes every goroutine parked on a connection.
var pastDeadline = time.Unix(1, 0)

func (t *Relay) setDeadlines(when time.Time) {
	for _, c := range t.conns {
		c.SetDeadline(when)
	}
}

func (t *Relay) runDirection(d Direction) {
	defer t.exit(d)
	if EndReason(t.dirs[d].end.Load()) == EndEOF {
		return // ended before a pause (Resume)
	}
	src, dst := t.conns[d], t.conns[1-d]
	srcEnd, srcOK := sourceEnd(src)
	dstEnd, dstOK := sinkEnd(dst)
	if p := t.pending[d]; p != nil {
		// What the paused relay's pipe held precedes everything the
		// source has yet to give. Resume made sure the sink splices.
		t.pending[d] = nil
		sd := &spliced{t: t, dst: dstEnd, p: p}
		sd.flush = sd.flushPipe
		err := sd.drain(d)
		if sd.p != nil {
			sd.p.close()
		}
		if err != nil {
			t.finish(d, dst, err)
			return
		}
	}
	var err error
	if srcOK && dstOK {
		t.dirs[d].spliced.Store(true)
		err = t.spliceLoop(d, src, srcEnd, dst, dstEnd)
	} else {
		t.dirs[d].spliced.Store(false)
		err = t.copyLoop(d, src, dst)
	}
	t.finish(d, dst, err)
}

// finish records how direction d ended; err == nil means its source ended.
func (t *Relay) finish(d Direction, dst net.Conn, err error) {
	s := &t.dirs[d]
	if err == ErrPaused {
		s.end.Store(uint32(EndPaused))
		return
	}
	if err == nil && t.opts.RequireCloseNotify[d] {
		if cn, ok := t.conns[d].(CloseNotifier); ok && !cn.CloseNotified() {
			err = fmt.Errorf("source: %w", ErrTruncated)
		}
	}
	// The state is read before the other direction's sinkClosing. That
	// direction sets sinkClosing just before it half-closes this socket, and
	// once the peer has sent its FIN, our FIN leaves the socket in TCP_CLOSE
	// as soon as the peer acknowledges it, like a reset: read after a
	// sinkClosing that was still false, the state could show that orderly end.
	if err == nil && sockerr.Reset(t.conns[d]) && !t.dirs[1-d].sinkClosing.Load() {
		// A kTLS source can report the end of a reset connection as a plain
		// end of stream (as on Linux 6.1: docs/kernel/behaviour.md), and the kernel
		// then lets splice keep "writing" into the dead socket: half-closing
		// would leave the other direction running forever. A reset ends the
		// whole tunnel.
		err = fmt.Errorf("source: %w", syscall.ECONNRESET)
	}
	if err == nil {
		cw, ok := dst.(closeWriter)
		if ok && !t.opts.CloseOnEOF {
			s.sinkClosing.Store(true)
			err = t.closeWrite(d, cw)
			if err == nil {
				s.end.Store(uint32(EndEOF))
				return
			}
			err = fmt.Errorf("half-close sink: %w", err)
		} else {
			s.end.Store(uint32(EndEOF))
			t.abort(EndAborted)
			return
		}
	}
	if r := EndReason(t.abortReason.Load()); r != EndRunning {
		// Woken by abort: the deadline error is ours, not the peer's.
		s.end.Store(uint32(r))
		return
	}
	s.mu.Lock()
	s.err = err
	s.mu.Unlock()
	s.end.Store(uint32(EndError))
	if (sinkPeerGone(err) || sinkClosedUnder(err)) && EndReason(t.dirs[1-d].end.Load()) == EndRunning {
		// The sink's peer reset the connection or closed it with our bytes
		// unread, but what it sent before that is still queued on the
		// socket the other direction reads: let it deliver those bytes and
		// meet the reset (or EOF) itself, which comes right after them. An
		// abort now would drop them (a target's last answer before it
		// hangs up). A sink closed under us: the other direction reports
		// why (a refusal must be passed on as one). The timer bounds a sink
		// on the other side that stalls.
		// Only one direction gets here: each stores its end above before it
		// looks at the other's.
		t.peerGone.Store(time.AfterFunc(peerGoneGrace, func() { t.abort(EndAborted) }))
		return
	}
	t.abort(EndAborted)
}

// spliceEnd is a connection's socket as one end of a spliced direction.
type spliceEnd struct {
	rc syscall.RawConn
	// ktls: the kernel opens (source) or seals (sink) TLS records inside
	// each splice(2) on rc. A kTLS source's splice failures are control
	// records for its Read.
	ktls   bool
	sealer Sealer // a sink's, when it implements Sealer
	opener Opener // a source's, when it implements Opener
}

// sourceEnd returns the socket to splice from; ok is false when c must be
// read through its Read method.
func sourceEnd(c net.Conn) (end spliceEnd, ok bool) {
	if s, isSource := c.(Source); isSource {
		rc, ok := s.SpliceSource()
		o, _ := c.(Opener)
		return spliceEnd{rc: rc, ktls: true, opener: o}, ok
	}
	return tcpEnd(c)
}

// sinkEnd returns the socket to splice into; ok is false when c must be
// written through its Write method.
func sinkEnd(c net.Conn) (end spliceEnd, ok bool) {
	if s, isSink := c.(Sink); isSink {
		rc, ok := s.SpliceSink()
		sl, _ := c.(Sealer)
		return spliceEnd{rc: rc, ktls: true, sealer: sl}, ok
	}
	return tcpEnd(c)
}

func tcpEnd(c net.Conn) (spliceEnd, bool) {
	if tc, ok := c.(*net.TCPConn); ok {
		if rc, err := tc.SyscallConn(); err == nil {
			return spliceEnd{rc: rc}, true
		}
	}
	return spliceEnd{}, false
}

// spliceLoop moves src → pipe → dst until src ends (nil) or fails.
//
// Each burst: wait for src to be readable holding no pipe; take a pipe;
// splice src → pipe (up to the pipe's size), then pipe → dst until the pipe
// is empty; repeat until src would block; give the empty pipe back. A kTLS
// source yields at most one record per splice(2) (tls_sw_splice_read, in
// every kernel up to 7.3 at least; docs/kernel has a patch that gathers
// them), so while full records are ready they are gathered, up to
// recordBatch, before the pipe is drained. Because
// the pipe is always drained before the next read from src, it is empty
// whenever src fails, so a control record's data (from src.Read) is written
// after every byte that preceded it: order is preserved. A burst that finds
// no pipe for lack of descriptors is one Read and Write through userspace
// (copyOnce) with no pipe held, so order is kept there too; the next burst
// asks for a pipe again.
func (t *Relay) spliceLoop(d Direction, src net.Conn, srcEnd spliceEnd, dst net.Conn, dstEnd spliceEnd) error {
	sd := &spliced{t: t, src: srcEnd, dst: dstEnd}
	// Method values made once: the callbacks syscall.RawConn takes would
	// otherwise be allocated anew (with what they capture) for every burst.
	sd.fill, sd.flush = sd.fillPipe, sd.flushPipe
	// Kept in sd, not on the stack: a direction that runs on Run's caller
	// can park within about a hundred bytes of its 16 KiB stack (a field
	// more in spliceEnd doubled an open gateway tunnel's stack).
	sd.waiter, _ = src.(Waiter)
	defer func() {
		if sd.p != nil {
			t.pipes.put(sd.p)
		}
	}()
	controlInARow := 0
	lim := t.opts.Limit[d]
	for {
		sd.n, sd.serr, sd.perr = 0, nil, nil
		sd.lim, sd.wait = lim, 0
		if sd.waiter != nil {
			sd.waiter.BeginWait()
		}
		err := srcEnd.rc.Read(sd.fill)
		if sd.waiter != nil && sd.waiter.EndWait(err) {
			continue
		}
		n, serr, perr := sd.n, sd.serr, sd.perr
		if sd.wait > 0 && err == nil && perr == nil {
			// The source is readable but the Limiter grants nothing yet:
			// wait with the bytes in the kernel, then splice again.
			if !t.throttleWait(d, sd.wait) {
				if t.aborting() {
					return t.stoppedErr()
				}
				if t.stop(d, &sd.p, 0) {
					return ErrPaused
				}
			}
			continue
		}
		switch {
		case err != nil && t.pausing(err):
			// Parked for readability with the pipe empty: a safe point.
			if t.stop(d, &sd.p, 0) {
				return ErrPaused
			}
			continue
		case err != nil:
			return fmt.Errorf("source: %w", sockerr.ReadError(src, err))
		case pipeShortage(perr):
			t.dirs[d].pipeShortages.Add(1)
			if end, err := t.copyOnce(d, src, dst); end {
				return err
			}
			controlInARow = 0
			continue
		case perr != nil:
			return perr
		case serr != nil && srcEnd.ktls && serr != unix.EBADMSG:
			if controlInARow++; controlInARow > maxControlRecordsInARow {
				return fmt.Errorf("source: %d control records in a row without data (last splice error: %w)", controlInARow-1, serr)
			}
			if err := t.controlRecord(d, src, dst); err != nil {
				if err == io.EOF {
					return nil
				}
				return err
			}
			continue
		case serr != nil:
			return os.NewSyscallError("splice source", serr)
		case n == 0:
			return nil
		}
		controlInARow = 0
		sd.p.buffered = int(n)
		if srcEnd.opener != nil {
			// Failing here drops what the pipe holds with the pipe (put).
			if err := srcEnd.opener.Opened(n); err != nil {
				return fmt.Errorf("source: %w", err)
			}
		}
		if err := sd.drain(d); err != nil {
			return err
		}
	}
}

// spliced is one spliced direction's state between the calls syscall.RawConn
// makes of its callbacks: the pipe of the current burst and what the last
// splice(2) returned.
type spliced struct {
	t        *Relay
	src, dst spliceEnd
	p        *pipe // the burst's pipe; nil between bursts
	// fill's results: bytes moved into the pipe, the splice(2) error, the
	// error of taking a pipe.
	n          int64
	serr, perr error
	// flush's request and results: bytes to move out of the pipe, bytes
	// moved, the splice(2) (or BeginSeal) error.
	want int
	m    int64
	werr error
	// fill and flush as func values, made once (spliceLoop).
	fill, flush func(fd uintptr) bool
	// waiter marks the source's waits (nil: it does not).
	waiter Waiter
	// lim is the direction's Limiter (nil: none); wait, set by fill, is
	// how long it asked the direction to wait before the next fill.
	lim  Limiter
	wait time.Duration
}

// fillPipe is the source's read callback: it takes a pipe if the burst has
// none and splices src → pipe. On EAGAIN the burst is over and the pipe is
// empty: it gives the pipe back before the goroutine parks, so an idle
// tunnel holds no pipe.
func (sd *spliced) fillPipe(fd uintptr) bool {
	t := sd.t
	if sd.p == nil {
		if sd.p, sd.perr = t.pipes.get(); sd.perr != nil {
			return true
		}
	}
	p := sd.p
	// A call from a kTLS source opens records inside the call, which keeps
	// its P (spliceSyscall): it asks for at most a batch.
	ask := p.size
	if sd.src.ktls {
		ask = min(p.size, recordBatch)
	}
	if sd.lim != nil {
		// Asked only now that the source is readable: an idle tunnel
		// holds no grant.
		grant, wait := sd.lim.Grant(ask)
		if grant == 0 {
			sd.wait = wait
			return true
		}
		ask = grant
		defer func() { sd.lim.Refund(ask - int(max(sd.n, 0))) }()
	}
	sd.n, sd.serr = t.splice(int(fd), p.wfd, ask, spliceFlags)
	if sd.serr == unix.EAGAIN {
		t.pipes.put(p)
		sd.p = nil
		return false
	}
	// Gather full records while the kernel hands them out one per call. A
	// call that moved more came from a kernel that gathers them itself,
	// and it took all that were ready. Whatever ends the batch (a short
	// record, EAGAIN, a control record, EOF) is met again by the next call,
	// after the drain.
	for last := sd.n; sd.src.ktls && sd.serr == nil && last == maxRecordPlaintext && int(sd.n)+maxRecordPlaintext <= ask; {
		m, err := t.splice(int(fd), p.wfd, ask-int(sd.n), spliceFlags)
		if err != nil || m == 0 {
			break
		}
		sd.n, last = sd.n+m, m
	}
	return true
}

// flushPipe is the sink's write callback: one splice(2) of up to want bytes
// pipe → sink, bracketed by the sink's BeginSeal and EndSeal when it seals.
func (sd *spliced) flushPipe(fd uintptr) bool {
	sd.m = 0
	if s := sd.dst.sealer; s != nil {
		if sd.werr = s.BeginSeal(fd); sd.werr != nil {
			return sd.werr != unix.EAGAIN
		}
		sd.m, sd.werr = sd.t.splice(sd.p.rfd, int(fd), sd.want, spliceFlags)
		s.EndSeal(max(sd.m, 0))
	} else {
		sd.m, sd.werr = sd.t.splice(sd.p.rfd, int(fd), sd.want, spliceFlags)
	}
	if sd.werr != unix.EAGAIN {
		return true
	}
	if sd.dst.ktls {
		if err := pushSealed(int(fd)); err != nil {
			sd.werr = err
			return true
		}
	}
	return false
}

// pushSealed makes TCP send what a kTLS sink has sealed and queued.
//
// The kernel surprises here: before Linux 6.5 (splice through sendpage) a
// kTLS socket hands each record it seals to TCP with the splice's "more"
// flag, which every pipe buffer but the last carries, so TCP queues it
// without sending. When the socket then has no room for the next record,
// the splice returns EAGAIN without pushing what TCP holds; with nothing in
// flight no ACK comes to push it, and the socket never becomes writable:
// the direction stalls for good. A send buffer that small is what TCP
// memory pressure makes of any socket (sk_stream_moderate_sndbuf). Setting
// TCP_NODELAY pushes the queue (tcp_push_pending_frames); a plain TCP sink
// pushes by itself before it waits for room.
func pushSealed(fd int) error {
	if err := unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1); err != nil {
		return os.NewSyscallError("setsockopt TCP_NODELAY (push before waiting for room)", err)
	}
	return nil
}

// drain splices everything buffered in the pipe into the sink, counting
// after every call. A call into a kTLS sink carries at most maxSealPerCall.
func (sd *spliced) drain(d Direction) error {
	p := sd.p
	for p.buffered > 0 {
		sd.want = p.buffered
		if sd.dst.ktls {
			sd.want = min(sd.want, maxSealPerCall)
		}
		sd.werr = nil
		if err := sd.dst.rc.Write(sd.flush); err != nil {
			if !sd.t.pausing(err) {
				return sinkError{fmt.Errorf("sink: %w", err)}
			}
			// The deadline that stops the direction refuses the write
			// before trying it: give the sink what it takes now, and
			// hand what it does not take over with the pipe.
			if err := sd.flushNow(d); err != nil {
				return err
			}
			if sd.t.stop(d, &sd.p, 0) {
				return ErrPaused
			}
			continue
		}
		if sd.werr != nil {
			return sinkError{os.NewSyscallError("splice sink", sd.werr)}
		}
		if sd.m == 0 {
			return errors.New("splice sink: moved 0 bytes from a non-empty pipe")
		}
		p.buffered -= int(sd.m)
		sd.t.count(d, sd.m, true)
	}
	return nil
}

// controlRecord lets the source's userspace path handle the record that
// splice(2) could not read, and forwards any data bytes it yields. It
// returns io.EOF when the record was close_notify.
func (t *Relay) controlRecord(d Direction, src, dst net.Conn) error {
	bufp := copyBuffers.Get().(*[]byte)
	defer copyBuffers.Put(bufp)
	n, err := src.Read(*bufp)
	if n == 0 && t.pausing(err) {
		// The record stays in the socket for whoever reads it next.
		if t.stop(d, nil, 0) {
			return ErrPaused
		}
		return nil
	}
	t.dirs[d].controlRecords.Add(1)
	if n > 0 {
		if werr := t.write(d, dst, (*bufp)[:n]); werr != nil {
			return werr
		}
	}
	if t.pausing(err) {
		// The Read took the record and what it returned is written.
		if t.stop(d, nil, 0) {
			return ErrPaused
		}
		return nil
	}
	if err != nil && err != io.EOF {
		return fmt.Errorf("source control record: %w", err)
	}
	return err
}

// pipeShortage reports whether err is a pipe refused for lack of file
// descriptors, in the process (EMFILE) or the system (ENFILE, which pipe(2)
// also returns when the user's pipe memory hard limit is reached).
func pipeShortage(err error) bool {
	return errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE)
}

// copyLoop is the userspace path: read into a pooled buffer, write it all,
// until src ends (nil) or fails.
func (t *Relay) copyLoop(d Direction, src, dst net.Conn) error {
	for {
		if end, err := t.copyOnce(d, src, dst); end {
			return err
		}
	}
}

// copyOnce reads once from src into a pooled buffer and writes what it got
// to dst. end is true when src ended (err nil) or a step failed (err). The
// buffer is taken per Read; while blocked in Read a direction holds one
// buffer, since a userspace TLS source may hold decrypted bytes that no
// socket readiness would announce.
func (t *Relay) copyOnce(d Direction, src, dst net.Conn) (end bool, err error) {
	bufp := copyBuffers.Get().(*[]byte)
	defer copyBuffers.Put(bufp)
	n, rerr := src.Read(*bufp)
	lim := t.opts.Limit[d]
	for off := 0; off < n; {
		// The copy path holds the bytes already: it waits for their
		// grant before it writes them, so an idle tunnel holds none.
		m := n - off
		if lim != nil {
			if m = t.throttle(d, lim, m); m == 0 {
				return true, t.stoppedErr()
			}
		}
		if werr := t.write(d, dst, (*bufp)[off:off+m]); werr != nil {
			return true, werr
		}
		off += m
	}
	switch {
	case rerr == io.EOF:
		return true, nil
	case t.pausing(rerr):
		// Stopped by a Pause, with what the Read returned written.
		if t.stop(d, nil, 0) {
			return true, ErrPaused
		}
		return false, nil
	case rerr != nil:
		return true, fmt.Errorf("source: %w", sockerr.ReadError(src, rerr))
	}
	return false, nil
}

// throttle waits until lim grants direction d some of want bytes and
// returns the grant; 0 when the tunnel was aborted meanwhile.
func (t *Relay) throttle(d Direction, lim Limiter, want int) int {
	for {
		n, wait := lim.Grant(want)
		if n > 0 {
			return n
		}
		if !t.throttleWait(d, wait) {
			if t.aborting() {
				return 0
			}
			// A Pause: the direction holds want bytes, so it refuses.
			t.stop(d, nil, want)
		}
	}
}

// throttleWait waits for wait, adding it to direction d's Throttled time;
// false when the tunnel was aborted or a Pause started meanwhile.
func (t *Relay) throttleWait(d Direction, wait time.Duration) bool {
	start := time.Now()
	timer := time.NewTimer(wait)
	defer func() { t.dirs[d].throttled.Add(int64(time.Since(start))) }()
	select {
	case <-timer.C:
		return true
	case <-t.aborted:
	case <-t.pauseSignal():
	}
	timer.Stop()
	return false
}

// aborting reports whether abort has stopped the tunnel.
func (t *Relay) aborting() bool {
	return EndReason(t.abortReason.Load()) != EndRunning
}

// stoppedErr is the error of a direction that abort stopped while it
// waited for its Limiter: finish records the abort's reason for it.
func (t *Relay) stoppedErr() error {
	return fmt.Errorf("source: %w", os.ErrDeadlineExceeded)
}

func (t *Relay) write(d Direction, dst net.Conn, b []byte) error {
	for {
		n, err := dst.Write(b)
		if n > 0 {
			t.count(d, int64(n), false)
			b = b[n:]
		}
		switch {
		case err == nil:
			return nil
		case len(b) > 0 && t.pausing(err):
			// Bytes in this process's buffer cannot be handed over: the
			// Pause is refused and the write goes on.
			t.stop(d, nil, len(b))
		default:
			return sinkError{fmt.Errorf("sink: %w", err)}
		}
	}
}

func (t *Relay) count(d Direction, n int64, spliced bool) {
	s := &t.dirs[d]
	s.bytes.Add(n)
	if spliced {
		s.spliceBytes.Add(n)
	} else {
		s.copyBytes.Add(n)
	}
	if t.opts.OnBytes != nil {
		t.opts.OnBytes(d, int(n))
	}
}

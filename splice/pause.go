package splice

// Pause and resume: a running Relay stops at a safe point and a new Relay,
// in this process or another, continues the tunnel over the same sockets.
//
// Pause asks both directions to stop by moving both connections'
// deadlines into the past, as abort does, which wakes whatever is parked in
// the netpoller; a throttled direction is woken by pauseWake. Each
// direction, at the point where the deadline (or the wake) caught it,
// reports to the Pause and waits for its verdict (stop). Safe points:
//
//   - parked for its source's readability: its pipe, if it holds one, is
//     empty;
//   - draining into a sink: the deadline refuses the write before it is
//     tried, so the sink is given what it takes without waiting (flushNow),
//     and what it does not take stays in the pipe, whose read end is
//     handed over with its byte count: the new relay splices it into the
//     sink before it reads the source again;
//   - a kTLS source's control record not yet read: it stays in the socket.
//
// A direction on the copy path is never paused (PauseCopyPath): its sink
// may be a userspace TLS session, which a Write cut short by a deadline
// leaves corrupt for good. A spliced direction holding bytes in this
// process's memory (a control record's data, between its Read and the
// sink's Write) reports them and the Pause is refused: it clears the deadlines and the
// direction goes on where it was. So does a direction whose source ended
// while the deadline refused its sink's half-close (a kTLS sink's
// close_notify is a record write): it finishes the half-close, and Pause
// tries again once it has (Pause). A refusal leaves the relay as it was;
// only Throttled counts the time the wait was cut short.
//
// After a committed Pause the directions return ErrPaused without another
// operation on either connection, the deadlines are cleared, and Run
// returns ErrPaused without closing anything.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/wire"
)

// ErrPaused is Run's error after a Pause succeeded: both connections are
// open and the caller's.
var ErrPaused = errors.New("splice: relay paused")

// PauseReason says why Pause refused. The relay goes on as before.
type PauseReason string

// The reasons Pause refuses.
const (
	// A direction holds bytes in this process that its sink has not taken
	// (the copy path between its Read and its Write): they exist nowhere
	// a new owner could take them from.
	PauseBuffered PauseReason = "buffered"
	// The relay is ending: a direction failed or was aborted, is
	// half-closing its sink, or both directions have ended.
	PauseEnded PauseReason = "ended"
	// A running direction is on the copy path: its source or its sink is
	// in userspace (a crypto/tls session, say), whose Write a deadline
	// would leave corrupt for good. Such a tunnel is never paused.
	PauseCopyPath PauseReason = "copy-path"
	// Run has not started, another Pause is in progress, or one succeeded.
	PauseNotRunning PauseReason = "not-running"
	// Pause's context ended before both directions stopped.
	PauseCanceled PauseReason = "canceled"
)

// PauseError is Pause's refusal.
type PauseError struct {
	Reason PauseReason
	Err    error
}

func (e *PauseError) Error() string {
	return fmt.Sprintf("splice: pause refused (%s): %v", e.Reason, e.Err)
}

func (e *PauseError) Unwrap() error { return e.Err }

// Paused is a relay that Pause stopped: its state, and the pipes holding
// bytes its directions took from their sources that their sinks did not
// take.
type Paused struct {
	State PauseState
	// Pipes[d] is the read end of a pipe that holds exactly
	// State.Dirs[d].Pending bytes of direction d, nil when it holds none.
	// They are the caller's: it passes them on beside the connections
	// (their descriptors travel separately from the encoded State) and
	// closes its own (Close).
	Pipes [2]*os.File
}

// Close closes the pipes.
func (p *Paused) Close() error {
	var errs []error
	for i, f := range p.Pipes {
		if f != nil {
			errs = append(errs, f.Close())
			p.Pipes[i] = nil
		}
	}
	return errors.Join(errs...)
}

// Files returns the pipes that hold bytes, in Direction order (AToB
// first): the descriptors that travel beside the encoded State, as
// NewPaused takes them back.
func (p *Paused) Files() []*os.File {
	var files []*os.File
	for _, f := range p.Pipes {
		if f != nil {
			files = append(files, f)
		}
	}
	return files
}

// NewPaused returns the paused relay of s whose pipes are files, in Files'
// order: one for each direction with pending bytes. It refuses another
// number of files. The files stay the caller's.
func NewPaused(s PauseState, files []*os.File) (*Paused, error) {
	want := 0
	for _, pd := range s.Dirs {
		if pd.Pending > 0 {
			want++
		}
	}
	if len(files) != want {
		return nil, fmt.Errorf("splice: a paused relay's pipes: %d, want %d (one for each direction holding bytes)", len(files), want)
	}
	p := &Paused{State: s}
	for d, pd := range s.Dirs {
		if pd.Pending > 0 {
			p.Pipes[d], files = files[0], files[1:]
		}
	}
	return p, nil
}

// PauseState is what a new relay needs, beside the connections and the
// pipes, to continue a paused one. Dirs is indexed by Direction.
type PauseState struct {
	Dirs [2]PausedDirection
}

// PausedDirection is one direction of a paused relay.
type PausedDirection struct {
	// The counters at the pause (DirectionStats); the resumed relay
	// counts on from them.
	Bytes, SpliceBytes, CopyBytes, ControlRecords, PipeShortages int64
	Throttled                                                    time.Duration
	Spliced                                                      bool
	// End is EndRunning, or EndEOF when the direction had ended in order
	// (its source ended, its sink was half-closed): it stays ended.
	End EndReason
	// Pending is what the direction's pipe holds (Paused.Pipes): bytes
	// counted nowhere yet, which go to the sink before anything else.
	Pending int64
}

// Stats returns the counters as Stats.
func (s PauseState) Stats() Stats {
	var r [2]DirectionStats
	for d, pd := range s.Dirs {
		r[d] = DirectionStats{
			Bytes: pd.Bytes, SpliceBytes: pd.SpliceBytes, CopyBytes: pd.CopyBytes,
			ControlRecords: pd.ControlRecords, PipeShortages: pd.PipeShortages,
			Spliced: pd.Spliced, Throttled: pd.Throttled, End: pd.End,
		}
	}
	return Stats{AToB: r[AToB], BToA: r[BToA]}
}

// pauseRequest is one Pause in progress.
type pauseRequest struct {
	reports chan stopReport // one from each direction running when it began
	verdict chan struct{}   // closed once the Pause has decided
	commit  bool            // the decision, read after verdict
}

// stopReport is a direction stopped at a safe point, or returned.
type stopReport struct {
	d       Direction
	exited  bool  // the direction had returned (finish recorded how)
	closing bool  // its source ended and its sink's half-close is not done: the Pause is refused
	held    int   // bytes it holds in this process: the Pause is refused
	p       *pipe // its pipe, when it holds bytes
}

// Pause stops both directions at a safe point and returns the stopped
// relay's description; Run then returns ErrPaused and leaves both
// connections open, for the caller to hand over with Paused.Pipes. A
// direction that had ended in order stays ended (PausedDirection.End).
// Pause refuses with a *PauseError, and the relay goes on as if it had not
// been called, when a direction holds bytes in this process
// (PauseBuffered), when the relay is ending (PauseEnded), when it is not
// running (PauseNotRunning), or when ctx ends first (PauseCanceled).
//
// A direction whose source ended while its sink's half-close was under way
// refuses one try: Pause waits for it to finish the half-close, up to
// halfCloseWait, and tries again, which finds it ended in order.
func (t *Relay) Pause(ctx context.Context) (*Paused, error) {
	for {
		closing := -1
		p, err := t.pauseOnce(ctx, &closing)
		if closing < 0 {
			return p, err
		}
		wait := time.NewTimer(halfCloseWait)
		select {
		case <-t.exitedCh[closing]:
			wait.Stop()
		case <-wait.C:
			return nil, err
		case <-ctx.Done():
			wait.Stop()
			return nil, err
		}
	}
}

// halfCloseWait bounds Pause's wait for a direction to finish the
// half-close of its sink: one record (close_notify) and a shutdown, which
// wait only for a sink whose peer does not read. A variable for tests.
var halfCloseWait = time.Second

// pauseOnce is one try of Pause. When a direction's half-close refused
// it, it sets *closing to that direction.
func (t *Relay) pauseOnce(ctx context.Context, closing *int) (*Paused, error) {
	refuse := func(reason PauseReason, format string, args ...any) (*Paused, error) {
		return nil, &PauseError{Reason: reason, Err: fmt.Errorf(format, args...)}
	}
	t.pauseMu.Lock()
	running := 0
	for _, e := range t.exited {
		if !e {
			running++
		}
	}
	t.deadlineMu.Lock()
	paused := t.paused
	t.deadlineMu.Unlock()
	switch {
	case !t.started.Load() || t.conns[0] == nil || t.conns[1] == nil:
		t.pauseMu.Unlock()
		return refuse(PauseNotRunning, "Run has not started")
	case paused:
		t.pauseMu.Unlock()
		return refuse(PauseNotRunning, "the relay is paused already")
	case t.pauseReq != nil:
		t.pauseMu.Unlock()
		return refuse(PauseNotRunning, "another Pause is in progress")
	case running == 0:
		t.pauseMu.Unlock()
		return refuse(PauseEnded, "both directions have ended")
	}
	for d := range t.dirs {
		if t.exited[d] || t.dirs[d].end.Load() != uint32(EndRunning) {
			continue
		}
		// As runDirection chooses, whether it has yet or not.
		_, srcOK := sourceEnd(t.conns[d])
		_, dstOK := sinkEnd(t.conns[1-d])
		if !srcOK || !dstOK {
			t.pauseMu.Unlock()
			return refuse(PauseCopyPath, "%s runs the copy path", Direction(d))
		}
	}
	req := &pauseRequest{reports: make(chan stopReport, 2), verdict: make(chan struct{})}
	t.pauseReq = req
	close(t.pauseWake)
	t.pauseWake = make(chan struct{})
	t.pauseMu.Unlock()

	t.deadlineMu.Lock()
	if !t.aborting() {
		t.setDeadlines(pastDeadline)
	}
	t.deadlineMu.Unlock()

	var reps [2]*stopReport
	var err error
	for got := 0; got < running && err == nil; got++ {
		select {
		case r := <-req.reports:
			reps[r.d] = &r
		case <-ctx.Done():
			err = &PauseError{Reason: PauseCanceled, Err: context.Cause(ctx)}
		}
	}
	if err == nil {
		err = t.pauseRefusal(reps)
		for d, r := range reps {
			if err != nil && r != nil && r.closing {
				*closing = d
			}
		}
	}
	// Decided under deadlineMu: an abort either came first (refused) or
	// finds the relay paused and leaves the deadlines cleared.
	t.deadlineMu.Lock()
	if err == nil && t.aborting() {
		err = &PauseError{Reason: PauseEnded, Err: errors.New("the relay was aborted")}
	}
	commit := err == nil
	t.paused = commit
	if !t.aborting() {
		t.setDeadlines(time.Time{})
	}
	t.deadlineMu.Unlock()
	t.pauseMu.Lock()
	t.pauseReq = nil
	req.commit = commit
	close(req.verdict)
	t.pauseMu.Unlock()
	if !commit {
		return nil, err
	}
	<-t.exitedCh[AToB]
	<-t.exitedCh[BToA]

	p := &Paused{}
	for d := range p.State.Dirs {
		ds := t.dirs[d].snapshot()
		pd := PausedDirection{
			Bytes: ds.Bytes, SpliceBytes: ds.SpliceBytes, CopyBytes: ds.CopyBytes,
			ControlRecords: ds.ControlRecords, PipeShortages: ds.PipeShortages,
			Throttled: ds.Throttled, Spliced: ds.Spliced, End: EndRunning,
		}
		if ds.End == EndEOF {
			pd.End = EndEOF
		}
		if r := reps[d]; r != nil && r.p != nil {
			rfd := r.p.rfd
			if !r.p.handed {
				rfd = t.pipes.detach(r.p)
			}
			pd.Pending = int64(r.p.buffered)
			p.Pipes[d] = os.NewFile(uintptr(rfd), "splice-pending")
		}
		p.State.Dirs[d] = pd
	}
	return p, nil
}

// pauseRefusal returns why the directions' reports forbid the pause, nil
// when they allow it.
func (t *Relay) pauseRefusal(reps [2]*stopReport) error {
	ended := 0
	for d := range reps {
		if r := reps[d]; r != nil && r.held > 0 {
			return &PauseError{Reason: PauseBuffered, Err: fmt.Errorf("%s holds %d bytes its sink has not taken", Direction(d), r.held)}
		}
		if r := reps[d]; r != nil && r.closing {
			return &PauseError{Reason: PauseEnded, Err: fmt.Errorf("%s is half-closing its sink", Direction(d))}
		}
		if r := reps[d]; r == nil || r.exited {
			ds := t.dirs[d].snapshot()
			if ds.End != EndEOF {
				return &PauseError{Reason: PauseEnded, Err: fmt.Errorf("%s ended (%s): %v", Direction(d), ds.End, ds.Err)}
			}
			ended++
		}
	}
	if ended == 2 {
		return &PauseError{Reason: PauseEnded, Err: errors.New("both directions have ended")}
	}
	return nil
}

// pausing reports whether err is the deadline with which a Pause (not
// abort) stops the directions.
func (t *Relay) pausing(err error) bool {
	return errors.Is(err, os.ErrDeadlineExceeded) && !t.aborting()
}

// pauseSignal returns a channel closed when a Pause is asking the
// directions to stop.
func (t *Relay) pauseSignal() <-chan struct{} {
	t.pauseMu.Lock()
	defer t.pauseMu.Unlock()
	if t.pauseReq != nil {
		// A direction reports once per Pause, which ends before it
		// returns: this one is asking the caller.
		return closedChan
	}
	return t.pauseWake
}

var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// stop parks direction d at a safe point while a Pause decides: pp is its
// burst's pipe (nil or *pp nil: none), held the bytes it holds in this
// process (the Pause is then refused). It returns true when the relay
// paused: the direction returns ErrPaused with no other operation on
// either connection, and a pipe that held bytes is no longer its own (*pp
// is nil). It returns false when no Pause is asking (the deadline's wake
// outlived a refused one) or the Pause was refused: the direction goes on
// where it stopped.
func (t *Relay) stop(d Direction, pp **pipe, held int) bool {
	t.pauseMu.Lock()
	req := t.pauseReq
	if req == nil {
		t.pauseMu.Unlock()
		return false
	}
	var p *pipe
	if pp != nil && *pp != nil && (*pp).buffered > 0 {
		p = *pp
	}
	req.reports <- stopReport{d: d, held: held, p: p}
	t.pauseMu.Unlock()
	<-req.verdict
	if !req.commit {
		return false
	}
	if p != nil {
		*pp = nil
	}
	return true
}

// closeWrite half-closes direction d's sink, whose source ended. A
// Pause's deadline refuses a kTLS sink's close_notify before the record
// is written (CloseWrite can be tried again): the direction refuses that
// Pause, since the half-close is this relay's to finish, and tries again
// once the Pause has cleared the deadlines. A Pause that finds d here
// counts on its report: d had not returned when it began.
func (t *Relay) closeWrite(d Direction, cw closeWriter) error {
	for {
		err := cw.CloseWrite()
		if !t.pausing(err) {
			return err
		}
		t.pauseMu.Lock()
		req := t.pauseReq
		if req != nil {
			req.reports <- stopReport{d: d, closing: true}
		}
		t.pauseMu.Unlock()
		if req != nil {
			// Refused: the deadlines are cleared before the verdict.
			<-req.verdict
		}
		// With no Pause asking, the one whose deadline this was has
		// cleared it (it ended when its context did), or a new one has
		// yet to set its own.
	}
}

// exit records that direction d returned, for a Pause that counts on it.
func (t *Relay) exit(d Direction) {
	t.pauseMu.Lock()
	t.exited[d] = true
	if req := t.pauseReq; req != nil {
		req.reports <- stopReport{d: d, exited: true}
	}
	t.pauseMu.Unlock()
	close(t.exitedCh[d])
}

// flushNow splices from the pipe into the sink what the sink takes without
// waiting. It goes through Control, which a deadline does not refuse. A
// sink that parked the direction may take more here: TCP wakes a writer
// only once a third of its send buffer is free (sk_stream_is_writeable),
// and takes less than that without a wake.
func (sd *spliced) flushNow(d Direction) error {
	p := sd.p
	for p.buffered > 0 {
		sd.want = p.buffered
		if sd.dst.ktls {
			sd.want = min(sd.want, maxSealPerCall)
		}
		sd.werr = nil
		var full bool
		if err := sd.dst.rc.Control(func(fd uintptr) { full = !sd.flush(fd) }); err != nil {
			return sinkError{fmt.Errorf("sink: %w", err)}
		}
		switch {
		case full:
			return nil
		case sd.werr != nil:
			return sinkError{os.NewSyscallError("splice sink", sd.werr)}
		case sd.m == 0:
			return errors.New("splice sink: moved 0 bytes from a non-empty pipe")
		}
		p.buffered -= int(sd.m)
		sd.t.count(d, sd.m, true)
	}
	return nil
}

// Resume returns a relay that continues a paused one between a and b: the
// paused relay's connections, or connections over the same sockets (made
// from descriptors another process passed on). Its counters go on from
// p.State's, so Stats stays cumulative; a direction that had ended stays
// ended; a direction's pending bytes (p.Pipes) go to its sink before it
// reads its source again. Resume does not take p's pipes: the relay holds
// duplicates until Run has delivered their bytes (or returns), and the
// caller closes p. It refuses a state that does not match p's pipes (the
// pipe must hold exactly Pending bytes: FIONREAD), and pending bytes whose
// sink cannot be spliced into.
func Resume(a, b net.Conn, p *Paused, opts Options) (*Relay, error) {
	if a == nil || b == nil {
		return nil, errors.New("splice: resume: a nil connection")
	}
	if err := p.State.validate(); err != nil {
		return nil, err
	}
	t := newRelay(a, b, opts, spliceSyscall)
	for d, pd := range p.State.Dirs {
		f := p.Pipes[d]
		var err error
		switch {
		case pd.Pending == 0 && f != nil:
			err = errors.New("a pipe, and no pending bytes in the state")
		case pd.Pending > 0 && f == nil:
			err = fmt.Errorf("%d pending bytes in the state, and no pipe", pd.Pending)
		case pd.Pending > 0:
			if _, ok := sinkEnd(t.conns[1-d]); !ok {
				err = fmt.Errorf("%d pending bytes for a sink that cannot be spliced into (%T)", pd.Pending, t.conns[1-d])
				break
			}
			var rfd int
			if rfd, err = adoptPipe(f, pd.Pending); err == nil {
				t.pending[d] = &pipe{rfd: rfd, wfd: -1, buffered: int(pd.Pending), handed: true}
			}
		}
		if err != nil {
			for _, q := range t.pending {
				if q != nil {
					q.close()
				}
			}
			return nil, fmt.Errorf("splice: resume: %s: %w", Direction(d), err)
		}
		s := &t.dirs[d]
		s.bytes.Store(pd.Bytes)
		s.spliceBytes.Store(pd.SpliceBytes)
		s.copyBytes.Store(pd.CopyBytes)
		s.controlRecords.Store(pd.ControlRecords)
		s.pipeShortages.Store(pd.PipeShortages)
		s.throttled.Store(int64(pd.Throttled))
		s.spliced.Store(pd.Spliced)
		s.end.Store(uint32(pd.End))
		s.sinkClosing.Store(pd.End == EndEOF)
	}
	return t, nil
}

// Discard releases what Resume took for a relay that will never run (the
// other process kept the tunnel): the duplicates of the pipes handed over.
// The connections stay the caller's. Only before Run.
func (t *Relay) Discard() {
	for d, q := range t.pending {
		if q != nil {
			q.close()
			t.pending[d] = nil
		}
	}
}

// adoptPipe checks that f is a pipe holding exactly want bytes and
// returns a non-blocking duplicate of its descriptor.
func adoptPipe(f *os.File, want int64) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	dup := -1
	cerr := rc.Control(func(fd uintptr) {
		var st unix.Stat_t
		if err = unix.Fstat(int(fd), &st); err != nil {
			return
		}
		if st.Mode&unix.S_IFMT != unix.S_IFIFO {
			err = fmt.Errorf("%s is not a pipe (mode %#o)", f.Name(), st.Mode)
			return
		}
		var n int
		// TIOCINQ is FIONREAD: on a pipe, the bytes it holds.
		if n, err = unix.IoctlGetInt(int(fd), unix.TIOCINQ); err != nil {
			return
		}
		if int64(n) != want {
			err = fmt.Errorf("the pipe holds %d bytes, the state says %d", n, want)
			return
		}
		if dup, err = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0); err != nil {
			return
		}
		// The description is shared with f's: an owner that made it
		// blocking (os.File.Fd) would otherwise block splice(2) on it.
		err = unix.SetNonblock(dup, true)
	})
	if err = errors.Join(cerr, err); err != nil {
		if dup >= 0 {
			unix.Close(dup)
		}
		return -1, err
	}
	return dup, nil
}

// PauseVersion is the version of PauseState's encoding (its first byte).
// A decoder refuses every other version.
const PauseVersion = 2

// PauseVersionError is a state encoded in a version this package does not
// read.
type PauseVersionError struct {
	Got int
}

func (e *PauseVersionError) Error() string {
	return fmt.Sprintf("splice: pause state version %d, this build reads only version %d", e.Got, PauseVersion)
}

// pauseEnds numbers the ends a paused direction can have in the encoding.
var pauseEnds = []EndReason{EndRunning, EndEOF}

// Encode returns s in the current PauseVersion (internal/wire): per
// direction, AToB first, the counters (bytes, spliced, copied, control
// records, pipe shortages, throttled nanoseconds), whether it spliced, its
// end and its pending bytes.
func (s *PauseState) Encode() ([]byte, error) {
	if err := s.validate(); err != nil {
		return nil, err
	}
	return s.encode(), nil
}

// encode is Encode of a state already validated.
func (s *PauseState) encode() []byte {
	w := wire.NewWriter(PauseVersion, 64)
	for _, pd := range s.Dirs {
		for _, v := range []int64{pd.Bytes, pd.SpliceBytes, pd.CopyBytes, pd.ControlRecords, pd.PipeShortages, int64(pd.Throttled)} {
			w.Int(v)
		}
		w.Bool(pd.Spliced)
		w.Uint(uint64(slices.Index(pauseEnds, pd.End)))
		w.Int(pd.Pending)
	}
	return w.B
}

// DecodePauseState decodes what Encode wrote. It refuses another version
// (*PauseVersionError), a state cut short or with anything after it, and
// a state Resume could not use.
func DecodePauseState(b []byte) (PauseState, error) {
	r := wire.NewReader(b)
	if v := r.Version(); r.Err() == nil && v != PauseVersion {
		return PauseState{}, &PauseVersionError{Got: int(v)}
	}
	var s PauseState
	for d := range s.Dirs {
		pd := &s.Dirs[d]
		r.Field(Direction(d).String())
		for _, v := range []*int64{&pd.Bytes, &pd.SpliceBytes, &pd.CopyBytes, &pd.ControlRecords, &pd.PipeShortages, (*int64)(&pd.Throttled)} {
			*v = r.Int()
		}
		pd.Spliced = r.Bool()
		r.Field(Direction(d).String() + " end")
		pd.End = pauseEnds[r.Index(len(pauseEnds))]
		r.Field(Direction(d).String())
		pd.Pending = r.Int()
	}
	if err := r.End(); err != nil {
		return PauseState{}, fmt.Errorf("splice: pause state: %w", err)
	}
	if err := s.validate(); err != nil {
		return PauseState{}, err
	}
	return s, nil
}

// validate checks what Pause guarantees: counters that add up, and an end
// a new relay can continue from.
func (s *PauseState) validate() error {
	for d, pd := range s.Dirs {
		var err error
		switch {
		case pd.End != EndRunning && pd.End != EndEOF:
			err = fmt.Errorf("end %s: only a running or an ended (eof) direction continues", pd.End)
		case pd.Bytes < 0 || pd.SpliceBytes < 0 || pd.CopyBytes < 0 || pd.ControlRecords < 0 || pd.PipeShortages < 0 || pd.Throttled < 0 || pd.Pending < 0:
			err = errors.New("a negative counter")
		case pd.Bytes != pd.SpliceBytes+pd.CopyBytes:
			err = fmt.Errorf("%d bytes, %d spliced and %d copied", pd.Bytes, pd.SpliceBytes, pd.CopyBytes)
		case pd.Pending > 0 && pd.End != EndRunning:
			err = fmt.Errorf("%d pending bytes in a direction that ended", pd.Pending)
		}
		if err != nil {
			return fmt.Errorf("splice: pause state: %s: %w", Direction(d), err)
		}
	}
	return nil
}

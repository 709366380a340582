package splice

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/splicetest"
)

// pacedRead reads exactly n bytes from r in chunks of at most 32 KiB,
// sleeping pace after each, and returns their SHA-256. A chunk is read
// holding gate's read lock: a test that holds gate stops the reader, so
// that its sink backs up.
func pacedRead(r io.Reader, n int64, pace time.Duration, gate *sync.RWMutex) ([]byte, error) {
	h := sha256.New()
	buf := make([]byte, 32<<10)
	for got := int64(0); got < n; {
		gate.RLock()
		m, err := r.Read(buf[:min(int64(len(buf)), n-got)])
		gate.RUnlock()
		h.Write(buf[:m])
		got += int64(m)
		if err != nil {
			return nil, err
		}
		time.Sleep(pace)
	}
	return h.Sum(nil), nil
}

// goPacedRead starts pacedRead; got waits for it and fails the test if it
// failed.
func goPacedRead(r io.Reader, n int64, pace time.Duration, gate *sync.RWMutex) (got func(t *testing.T) []byte) {
	done := make(chan struct{})
	var sum []byte
	var err error
	go func() {
		defer close(done)
		sum, err = pacedRead(r, n, pace, gate)
	}()
	return func(t *testing.T) []byte {
		t.Helper()
		<-done
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		return sum
	}
}

// bounded gives the peers' reads and writes a deadline, so that a byte the
// tunnel loses fails the test instead of hanging it.
func bounded(t *testing.T, cs ...net.Conn) {
	for _, c := range cs {
		if err := c.SetDeadline(time.Now().Add(30 * time.Second)); err != nil {
			t.Fatal(err)
		}
	}
}

// moveConn hands c over as a process handoff does: a duplicate of its
// socket becomes a new net.Conn (net.FileConn), and c is closed.
func moveConn(t *testing.T, c net.Conn) net.Conn {
	t.Helper()
	fc, ok := c.(interface{ File() (*os.File, error) })
	if !ok {
		t.Fatalf("%T has no File method", c)
	}
	f, err := fc.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	nc, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	t.Cleanup(func() { nc.Close() })
	return nc
}

// movePipes replaces p's pipes by duplicates, as SCM_RIGHTS would, and
// closes the originals: the pipes travel as Files and come back through
// NewPaused.
func movePipes(t *testing.T, p *Paused) {
	t.Helper()
	var moved []*os.File
	for _, f := range p.Files() {
		fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		moved = append(moved, os.NewFile(uintptr(fd), "moved-pipe"))
	}
	p.Close()
	np, err := NewPaused(p.State, moved)
	if err != nil {
		t.Fatal(err)
	}
	*p = *np
}

// NewPaused takes a paused relay's pipes back in Files' order, one for
// each direction holding bytes, and refuses another number.
func TestNewPaused(t *testing.T) {
	r1, w1, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r1.Close()
	defer w1.Close()
	var st PauseState
	st.Dirs[BToA].Pending = 3
	p, err := NewPaused(st, []*os.File{r1})
	if err != nil || p.Pipes[AToB] != nil || p.Pipes[BToA] != r1 || p.State != st {
		t.Fatalf("NewPaused: %+v, %v; want BToA's pipe alone", p, err)
	}
	if files := p.Files(); len(files) != 1 || files[0] != r1 {
		t.Errorf("Files: %v, want BToA's pipe", files)
	}
	st.Dirs[AToB].Pending = 2
	p, err = NewPaused(st, []*os.File{w1, r1})
	if err != nil || p.Pipes[AToB] != w1 || p.Pipes[BToA] != r1 {
		t.Fatalf("NewPaused: %+v, %v; want AToB's pipe, then BToA's", p, err)
	}
	if files := p.Files(); len(files) != 2 || files[0] != w1 || files[1] != r1 {
		t.Errorf("Files: %v, want AToB's pipe, then BToA's", files)
	}
	for _, files := range [][]*os.File{nil, {r1}, {r1, w1, r1}} {
		if p, err := NewPaused(st, files); p != nil || err == nil {
			t.Errorf("NewPaused of %d pipes for two directions holding bytes: %+v, %v; want a refusal", len(files), p, err)
		}
	}
}

// pausing drives a tunnel through pauses: each cycle pauses the running
// relay, checks what Run returned against the paused state, hands the
// connections over (move) and resumes into a new Relay.
type pausing struct {
	t     *testing.T
	opts  Options
	tun   *Relay
	wait  func() (Stats, error)
	conns [2]net.Conn
	// move hands the connections over between pause and resume; nil
	// keeps them.
	move func(a, b net.Conn) (net.Conn, net.Conn)
	// pending counts the pauses that handed a pipe over, per direction.
	pending [2]int
}

func startPausing(t *testing.T, a, b net.Conn, opts Options) *pausing {
	tun := New(a, b, opts)
	return &pausing{t: t, opts: opts, tun: tun, wait: runStarted(t, tun), conns: [2]net.Conn{a, b}}
}

// runStarted is runRelay, returning once Run has begun: before, Pause
// refuses (PauseNotRunning).
func runStarted(t *testing.T, tun *Relay) (wait func() (Stats, error)) {
	wait = runRelay(t.Context(), tun)
	for !tun.started.Load() {
		time.Sleep(time.Millisecond)
	}
	return wait
}

// counters is a DirectionStats without what a pause does not carry.
func counters(ds DirectionStats) DirectionStats {
	ds.Err = nil
	if ds.End == EndPaused {
		ds.End = EndRunning
	}
	return ds
}

// cycle pauses, checks and resumes once; it returns the paused state.
func (pz *pausing) cycle() PauseState {
	t := pz.t
	t.Helper()
	p, err := pz.tun.Pause(t.Context())
	if err != nil {
		t.Fatalf("pause: %v", err)
	}
	res, err := pz.wait()
	if !errors.Is(err, ErrPaused) {
		t.Fatalf("Run after Pause: %v, want ErrPaused", err)
	}
	st := p.State
	for d := range st.Dirs {
		got, want := counters(res.Dir(Direction(d))), st.Stats().Dir(Direction(d))
		if got != want {
			t.Fatalf("%s: Run returned %+v, the paused state says %+v", Direction(d), got, want)
		}
		if end := res.Dir(Direction(d)).End; end != EndPaused && end != EndEOF {
			t.Fatalf("%s ended %s after Pause, want paused or eof", Direction(d), end)
		}
		if st.Dirs[d].Pending > 0 {
			pz.pending[d]++
		}
	}
	// The encoded state is what travels.
	enc, err := st.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if p.State, err = DecodePauseState(enc); err != nil {
		t.Fatal(err)
	}
	if pz.move != nil {
		pz.conns[0], pz.conns[1] = pz.move(pz.conns[0], pz.conns[1])
		movePipes(t, p)
	}
	next, err := Resume(pz.conns[0], pz.conns[1], p, pz.opts)
	if cerr := p.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatalf("resume: %v", err)
	}
	if got := next.Stats(); got != st.Stats() {
		t.Fatalf("resumed relay's counters %+v, the paused state's %+v", got, st.Stats())
	}
	pz.tun, pz.wait = next, runStarted(t, next)
	return st
}

// stalled waits until direction d of the running relay has moved nothing
// for 100 ms.
func (pz *pausing) stalled(d Direction) {
	last := pz.tun.Stats().Dir(d).Bytes
	for quiet := time.Now(); time.Since(quiet) < 100*time.Millisecond; {
		time.Sleep(10 * time.Millisecond)
		if n := pz.tun.Stats().Dir(d).Bytes; n != last {
			last, quiet = n, time.Now()
		}
	}
}

// smallSinks shrinks the send buffers of the relay's sockets and the
// receive buffers of the peers, so that a stalled reader backs the tunnel
// up into the relay's pipe soon and leaves more in it than the sink takes.
// The relay's receive buffers stay as they are: a burst fills the pipe.
func smallSinks(t *testing.T, tp topology) {
	for _, c := range []*net.TCPConn{tp.relayA, tp.relayB} {
		if err := c.SetWriteBuffer(64 << 10); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []*net.TCPConn{tp.client, tp.upstream} {
		if err := c.SetReadBuffer(64 << 10); err != nil {
			t.Fatal(err)
		}
	}
}

// TestPauseResumeLoop: a pattern each way through a spliced tunnel that is
// paused twelve times mid-stream, each time resumed into a new Relay, on
// duplicated sockets every other time (the process handoff's
// net.FileConn); every third time the reader of one side stops first, so
// that the pause hands that direction's pipe over with bytes in it (unless
// the sink took them all when asked once more). Both streams arrive exact
// and the last relay's counters are the streams' sizes.
func TestPauseResumeLoop(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 4)
	tp := newTopology(t)
	bounded(t, tp.client, tp.upstream)
	smallSinks(t, tp)
	const size = 32 * MiB
	var gates [2]sync.RWMutex // gates[d] stops the reader of direction d
	sentAB := goSend(tp.client, size, 11)
	sentBA := goSend(tp.upstream, size, 12)
	gotAB := goPacedRead(tp.upstream, size, time.Millisecond, &gates[AToB])
	gotBA := goPacedRead(tp.client, size, time.Millisecond, &gates[BToA])

	pz := startPausing(t, tp.relayA, tp.relayB, Options{Pipes: pool})
	var last PauseState
	for i := range 12 {
		time.Sleep(20 * time.Millisecond)
		d := Direction(i / 3 % 2)
		blocked := i%3 == 2
		if blocked {
			gates[d].Lock()
			pz.stalled(d)
		}
		if i%2 == 1 {
			pz.move = func(a, b net.Conn) (net.Conn, net.Conn) { return moveConn(t, a), moveConn(t, b) }
		} else {
			pz.move = nil
		}
		last = pz.cycle()
		if blocked {
			t.Logf("pause %d, %s's reader stopped: %+v", i, d, last.Dirs[d])
			gates[d].Unlock()
		}
	}
	for d, pd := range last.Dirs {
		if pd.Bytes+pd.Pending >= size {
			t.Fatalf("%s had moved everything (%d bytes, %d pending) by the last pause: the pauses must land mid-stream", Direction(d), pd.Bytes, pd.Pending)
		}
	}
	if pz.pending[AToB] == 0 || pz.pending[BToA] == 0 {
		t.Errorf("pauses with a pipe handed over: %v, want some in each direction", pz.pending)
	}
	if string(gotAB(t)) != string(sentAB(t)) || string(gotBA(t)) != string(sentBA(t)) {
		t.Fatal("a stream arrived corrupted through the pauses")
	}
	tp.client.CloseWrite()
	tp.upstream.CloseWrite()
	res, err := pz.wait()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []Direction{AToB, BToA} {
		ds := res.Dir(d)
		if ds.Bytes != size || ds.SpliceBytes != size || ds.CopyBytes != 0 || !ds.Spliced || ds.End != EndEOF {
			t.Errorf("%s: %+v, want %d bytes, all spliced, eof", d, ds, int64(size))
		}
	}
}

// TestPauseBlockedSink: the upstream reads nothing, so the client's
// stream backs up into the relay's pipe. The pause hands the pipe over
// with its bytes; the resumed relay is paused again while it still holds
// them (its sink is still blocked), which hands what is left of them on;
// the last relay delivers them first, then the rest: the upstream reads
// the stream exactly once, in order.
func TestPauseBlockedSink(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	tp := newTopology(t)
	bounded(t, tp.client, tp.upstream)
	smallSinks(t, tp)
	const size = 8 * MiB
	sent := goSend(tp.client, size, 21)
	pz := startPausing(t, tp.relayA, tp.relayB, Options{Pipes: pool})
	pz.move = func(a, b net.Conn) (net.Conn, net.Conn) { return moveConn(t, a), moveConn(t, b) }
	// A pause hands the pipe over with what the blocked sink does not
	// take at once. Where the burst that stalled was small (its sender
	// starved on a loaded machine), the sink takes all of it and nothing
	// is pending; the relay resumes, and its next burst fills the pipe
	// from the source that has backed up meanwhile.
	var first PausedDirection
	for range 20 {
		pz.stalled(AToB)
		if first = pz.cycle().Dirs[AToB]; first.Pending > 0 {
			break
		}
	}
	if first.Pending == 0 || first.Bytes == 0 {
		t.Fatalf("paused with the upstream not reading: %+v, want bytes delivered and bytes pending", first)
	}
	time.Sleep(50 * time.Millisecond)
	// The resumed relay drains the pending bytes before it reads its
	// source, and the sink is still blocked: the second pause hands on
	// what is left of the same bytes (the sink may have taken some, as
	// the kernel moved what its buffers held on to the upstream's).
	second := pz.cycle().Dirs[AToB]
	if second.Pending == 0 || second.Bytes+second.Pending != first.Bytes+first.Pending {
		t.Fatalf("second pause %+v, want what is left of the first's %d bytes and %d pending (%d in all), some still pending", second, first.Bytes, first.Pending, first.Bytes+first.Pending)
	}
	if st := pool.Stats(); st.InUse != 0 || st.Created != st.Destroyed+uint64(st.Idle) {
		t.Errorf("pool after the pauses: %+v, want the handed pipe counted closed", st)
	}
	got := readExact(t, tp.upstream, size)
	if string(got) != string(sent(t)) {
		t.Fatal("the upstream's stream differs from the client's: pending bytes lost, repeated or out of order")
	}
	tp.client.CloseWrite()
	tp.upstream.CloseWrite()
	res, err := pz.wait()
	if err != nil {
		t.Fatal(err)
	}
	if ds := res.AToB; ds.Bytes != size || ds.SpliceBytes != size || ds.End != EndEOF {
		t.Errorf("a->b %+v, want %d bytes spliced, eof", ds, int64(size))
	}
}

// TestPauseAfterHalfClose: the client's stream has ended and been passed
// on as a half-close when the relay is paused mid-way through the
// upstream's answer; the resumed relay keeps that direction ended and
// finishes the other.
func TestPauseAfterHalfClose(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	tp := newTopology(t)
	bounded(t, tp.client, tp.upstream)
	smallSinks(t, tp)
	const size = 4 * MiB
	pz := startPausing(t, tp.relayA, tp.relayB, Options{Pipes: pool})
	pz.move = func(a, b net.Conn) (net.Conn, net.Conn) { return moveConn(t, a), moveConn(t, b) }
	sentAB := goSend(tp.client, size, 31)
	if got := readExact(t, tp.upstream, size); string(got) != string(sentAB(t)) {
		t.Fatal("a->b corrupted")
	}
	tp.client.CloseWrite()
	if n, err := tp.upstream.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("upstream after the client's half-close: %d, %v; want EOF", n, err)
	}
	var gate sync.RWMutex
	gotBA := goPacedRead(tp.client, size, time.Millisecond, &gate)
	sentBA := goSend(tp.upstream, size, 32)
	time.Sleep(20 * time.Millisecond)
	st := pz.cycle()
	if ab := st.Dirs[AToB]; ab.End != EndEOF || ab.Bytes != size || ab.Pending != 0 {
		t.Fatalf("a->b in the paused state %+v, want ended (eof) after %d bytes", ab, int64(size))
	}
	if ba := st.Dirs[BToA]; ba.End != EndRunning || ba.Bytes+ba.Pending >= size {
		t.Fatalf("b->a in the paused state %+v, want running, mid-stream", ba)
	}
	if ds := pz.tun.Stats().AToB; ds.End != EndEOF {
		t.Fatalf("resumed relay's a->b %+v, want ended", ds)
	}
	if string(gotBA(t)) != string(sentBA(t)) {
		t.Fatal("b->a corrupted through the pause")
	}
	tp.upstream.CloseWrite()
	res, err := pz.wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.AToB.Bytes != size || res.AToB.End != EndEOF || res.BToA.Bytes != size || res.BToA.End != EndEOF {
		t.Errorf("result %+v, want %d bytes each way, both eof", res, int64(size))
	}
}

// recordConn is a RecordCloser whose first CloseWrite waits until a
// deadline in the past is on the socket (a Pause's); a later one waits for
// hold, when set, to be closed.
type recordConn struct {
	splicetest.RecordCloser
	entered chan struct{} // closed when the first CloseWrite begins
	hold    chan struct{}
	calls   atomic.Int32
}

func newRecordConn(c *net.TCPConn) *recordConn {
	return &recordConn{RecordCloser: splicetest.RecordCloser{TCPConn: c}, entered: make(chan struct{})}
}

func (c *recordConn) CloseWrite() error {
	if c.calls.Add(1) == 1 {
		close(c.entered)
		if rc, _ := c.SpliceSink(); !splicetest.AwaitPastDeadline(rc, 10*time.Second) {
			return errors.New("recordConn: no deadline came")
		}
		return c.WriteWait()
	}
	if c.hold != nil {
		<-c.hold
	}
	return c.RecordCloser.CloseWrite()
}

// halfClosing starts a relay between tp.relayA and tp.relayB as a
// recordConn, moves size bytes a->b and half-closes the client, and
// returns once a->b's CloseWrite waits for a Pause's deadline.
func halfClosing(t *testing.T, tp topology, opts Options, size int64) (*Relay, *recordConn, func() (Stats, error)) {
	sink := newRecordConn(tp.relayB)
	tun := New(tp.relayA, sink, opts)
	wait := runStarted(t, tun)
	sent := goSend(tp.client, size, 41)
	if got := readExact(t, tp.upstream, size); string(got) != string(sent(t)) {
		t.Fatal("a->b corrupted")
	}
	tp.client.CloseWrite()
	<-sink.entered
	return tun, sink, wait
}

// TestPauseDuringHalfClose: a Pause whose deadline interrupts a
// direction's half-close of its sink (a kTLS sink's close_notify refused
// before it is written) lets the direction finish the half-close, then
// pauses the relay with that direction ended in order; the resumed relay
// carries the other direction to its end.
func TestPauseDuringHalfClose(t *testing.T) {
	checkLeaks(t)
	tp := newTopology(t)
	bounded(t, tp.client, tp.upstream)
	opts := Options{Pipes: newTestPool(t, 2)}
	const size = 1 * MiB
	tun, sink, wait := halfClosing(t, tp, opts, size)
	p, err := tun.Pause(t.Context())
	if err != nil {
		t.Fatalf("Pause during the half-close: %v", err)
	}
	defer p.Close()
	if _, err := wait(); !errors.Is(err, ErrPaused) {
		t.Fatalf("Run after Pause: %v, want ErrPaused", err)
	}
	if ab := p.State.Dirs[AToB]; ab.End != EndEOF || ab.Bytes != size {
		t.Fatalf("a->b in the paused state %+v, want ended (eof) after %d bytes", ab, int64(size))
	}
	if ba := p.State.Dirs[BToA]; ba.End != EndRunning || ba.Bytes != 0 {
		t.Fatalf("b->a in the paused state %+v, want running, nothing moved", ba)
	}
	if n, err := tp.upstream.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("upstream after the client's half-close: %d, %v; want EOF", n, err)
	}
	if n := sink.calls.Load(); n != 2 {
		t.Errorf("CloseWrite called %d times, want 2 (interrupted, then done)", n)
	}
	next, err := Resume(tp.relayA, sink, p, opts)
	if err != nil {
		t.Fatal(err)
	}
	wait = runStarted(t, next)
	sent := goSend(tp.upstream, size, 42)
	if got := readExact(t, tp.client, size); string(got) != string(sent(t)) {
		t.Fatal("b->a corrupted after the resume")
	}
	tp.upstream.CloseWrite()
	res, err := wait()
	if err != nil {
		t.Fatalf("the resumed relay: %v", err)
	}
	if res.AToB.Bytes != size || res.AToB.End != EndEOF || res.BToA.Bytes != size || res.BToA.End != EndEOF {
		t.Errorf("result %+v, want %d bytes each way, both eof", res, int64(size))
	}
	if n := sink.calls.Load(); n != 2 {
		t.Errorf("CloseWrite called %d times in all, want 2", n)
	}
}

// TestPauseRefusedByAStalledHalfClose: a half-close that the Pause
// interrupted and that does not finish within halfCloseWait (its sink
// does not take the record) refuses the Pause as the relay ending; the
// relay goes on and ends in order once the half-close is done.
func TestPauseRefusedByAStalledHalfClose(t *testing.T) {
	checkLeaks(t)
	defer func(w time.Duration) { halfCloseWait = w }(halfCloseWait)
	halfCloseWait = 50 * time.Millisecond
	tp := newTopology(t)
	bounded(t, tp.client, tp.upstream)
	const size = 64 << 10
	tun, sink, wait := halfClosing(t, tp, Options{Pipes: newTestPool(t, 2)}, size)
	sink.hold = make(chan struct{})
	_, err := tun.Pause(t.Context())
	var pe *PauseError
	if !errors.As(err, &pe) || pe.Reason != PauseEnded || !strings.Contains(err.Error(), "half-closing") {
		t.Fatalf("Pause during a stalled half-close: %v; want refused (%s): half-closing", err, PauseEnded)
	}
	close(sink.hold)
	if n, err := tp.upstream.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Fatalf("upstream after the client's half-close: %d, %v; want EOF", n, err)
	}
	tp.upstream.CloseWrite()
	res, err := wait()
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if res.AToB.Bytes != size || res.AToB.End != EndEOF || res.BToA.End != EndEOF {
		t.Errorf("result %+v, want %d bytes a->b, both eof", res, int64(size))
	}
}

// TestPauseDrainsAnAcceptingSink: a direction parked mid-burst with bytes
// in its pipe, whose sink would take them (an injected EAGAIN parked it,
// so no wake comes), gives the sink those bytes when paused: nothing is
// pending, and everything is counted as delivered.
func TestPauseDrainsAnAcceptingSink(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	tp := newTopology(t)
	bounded(t, tp.client, tp.upstream)
	sink := socketFD(t, tp.relayB)
	var blocked atomic.Bool
	blocked.Store(true)
	stall := func(rfd, wfd, n, flags int) (int64, error) {
		if wfd == sink && blocked.CompareAndSwap(true, false) {
			return 0, unix.EAGAIN
		}
		return spliceSyscall(rfd, wfd, n, flags)
	}
	const size = 256 << 10
	tun := newRelay(tp.relayA, tp.relayB, Options{Pipes: pool}, stall)
	pz := &pausing{t: t, opts: Options{Pipes: pool}, tun: tun, wait: runStarted(t, tun), conns: [2]net.Conn{tp.relayA, tp.relayB}}
	sent := goSend(tp.client, size, 81)
	sum := sent(t)
	for blocked.Load() {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond)
	if ds := tun.Stats().AToB; ds.Bytes != 0 {
		t.Fatalf("a->b %+v before the pause, want parked with nothing delivered", ds)
	}
	if st := pool.Stats(); st.InUse != 1 {
		t.Fatalf("pool %+v before the pause, want the parked burst's pipe in use", st)
	}
	ab := pz.cycle().Dirs[AToB]
	if ab.Pending != 0 || ab.Bytes == 0 {
		t.Fatalf("a->b paused %+v, want its pipe drained into the sink", ab)
	}
	if got := readExact(t, tp.upstream, size); string(got) != string(sum) {
		t.Fatal("a->b corrupted")
	}
	tp.client.CloseWrite()
	tp.upstream.CloseWrite()
	res, err := pz.wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.AToB.Bytes != size {
		t.Errorf("a->b %+v, want %d bytes", res.AToB, size)
	}
}

// TestPauseRefusedOnTheCopyPath: a relay with a direction on the copy
// path (relayA hidden behind opaqueConn) is never paused, whether that
// direction holds bytes its sink has not taken (an upstream that reads
// nothing) or none: Pause refuses (PauseCopyPath) without touching a
// deadline, and both streams arrive exact.
func TestPauseRefusedOnTheCopyPath(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	tp := newTopology(t)
	bounded(t, tp.client, tp.upstream)
	smallSinks(t, tp)
	const size = 4 * MiB
	a := opaqueConn{tp.relayA}
	sentAB := goSend(tp.client, size, 51)
	pz := startPausing(t, a, tp.relayB, Options{Pipes: pool})
	pz.stalled(AToB)
	var pe *PauseError
	if _, err := pz.tun.Pause(t.Context()); !errors.As(err, &pe) || pe.Reason != PauseCopyPath {
		t.Fatalf("Pause with a copying direction blocked on its sink: %v, want a PauseError (%s)", err, PauseCopyPath)
	}
	if ds := pz.tun.Stats().AToB; ds.End != EndRunning || ds.Spliced {
		t.Fatalf("a->b after the refusal: %+v, want running on the copy path", ds)
	}
	var gate sync.RWMutex
	gotAB := goPacedRead(tp.upstream, size, 0, &gate)
	if string(gotAB(t)) != string(sentAB(t)) {
		t.Fatal("a->b corrupted after a refused pause")
	}
	// Nothing held now: both directions wait in Read; still refused.
	if _, err := pz.tun.Pause(t.Context()); !errors.As(err, &pe) || pe.Reason != PauseCopyPath {
		t.Fatalf("Pause with a copying direction holding nothing: %v, want a PauseError (%s)", err, PauseCopyPath)
	}
	sentBA := goSend(tp.upstream, size/2, 52)
	gotBA := readExact(t, tp.client, size/2)
	if string(gotBA) != string(sentBA(t)) {
		t.Fatal("b->a corrupted after a refused pause")
	}
	tp.client.CloseWrite()
	tp.upstream.CloseWrite()
	res, err := pz.wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.AToB.Bytes != size || res.AToB.CopyBytes != size || res.BToA.Bytes != size/2 || res.AToB.End != EndEOF || res.BToA.End != EndEOF {
		t.Errorf("result %+v, want %d bytes copied a->b and %d b->a, both eof", res, int64(size), int64(size/2))
	}
}

// TestPauseThrottled: a direction waiting for its Limiter (whose next
// grant is a second away) is stopped at once: the wait is cut short, not
// served, and the resumed relay, without a Limiter, delivers the rest.
func TestPauseThrottled(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	tp := newTopology(t)
	bounded(t, tp.client, tp.upstream)
	const size = 64 << 10
	lim := NewRateLimiter(minGrant, minGrant) // after the first grant, one a second
	sent := goSend(tp.client, size, 61)
	var gate sync.RWMutex
	got := goPacedRead(tp.upstream, size, 0, &gate)
	pz := startPausing(t, tp.relayA, tp.relayB, Options{Pipes: pool, Limit: [2]Limiter{AToB: lim}})
	for pz.tun.Stats().AToB.Bytes == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(50 * time.Millisecond) // waiting for the next grant
	start := time.Now()
	pz.opts.Limit[AToB] = nil
	st := pz.cycle()
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Errorf("pausing a throttled direction took %v; its wait should be cut short", took)
	}
	if ab := st.Dirs[AToB]; ab.Bytes == 0 || ab.Bytes > minGrant || ab.Throttled <= 0 || ab.Throttled >= time.Second {
		t.Errorf("a->b paused %+v, want the first grant's bytes and a throttled wait cut short", ab)
	}
	if string(got(t)) != string(sent(t)) {
		t.Fatal("a->b corrupted through the pause")
	}
	tp.client.CloseWrite()
	tp.upstream.CloseWrite()
	res, err := pz.wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.AToB.Bytes != size || res.AToB.Throttled != st.Dirs[AToB].Throttled {
		t.Errorf("a->b %+v, want %d bytes, throttled only before the pause", res.AToB, size)
	}
}

// TestPauseNotRunning: Pause before Run, and after Run returned, refuses
// and changes nothing.
func TestPauseNotRunning(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	tp := newTopology(t)
	bounded(t, tp.client, tp.upstream)
	tun := New(tp.relayA, tp.relayB, Options{Pipes: pool})
	var pe *PauseError
	if _, err := tun.Pause(t.Context()); !errors.As(err, &pe) || pe.Reason != PauseNotRunning {
		t.Fatalf("Pause before Run: %v, want %s", err, PauseNotRunning)
	}
	res, err := echoRun(t.Context(), tp, tun, 71, 1*MiB)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tun.Pause(t.Context()); !errors.As(err, &pe) || pe.Reason != PauseEnded {
		t.Fatalf("Pause after Run: %v, want %s", err, PauseEnded)
	}
	if res.AToB.Bytes != 1*MiB || res.BToA.Bytes != 1*MiB {
		t.Errorf("result %+v", res)
	}
}

// TestPauseStateEncoding: a state survives its encoding, its version
// first; another version, a state cut short or with more after it, and
// states Resume could not continue are refused, by the decoder too.
func TestPauseStateEncoding(t *testing.T) {
	st := PauseState{Dirs: [2]PausedDirection{
		{Bytes: 5 << 20, SpliceBytes: 5<<20 - 100, CopyBytes: 100, ControlRecords: 3, PipeShortages: 1, Throttled: 1500 * time.Millisecond, Spliced: true, End: EndRunning, Pending: 65536},
		{Bytes: 7, SpliceBytes: 0, CopyBytes: 7, End: EndEOF},
	}}
	enc, err := st.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if enc[0] != PauseVersion {
		t.Fatalf("encoding starts with %d, want the version %d", enc[0], PauseVersion)
	}
	got, err := DecodePauseState(enc)
	if err != nil {
		t.Fatal(err)
	}
	if got != st {
		t.Fatalf("round trip: %+v, want %+v", got, st)
	}

	var ve *PauseVersionError
	other := bytes.Clone(enc)
	other[0] = PauseVersion + 1
	if _, err := DecodePauseState(other); !errors.As(err, &ve) || ve.Got != PauseVersion+1 {
		t.Errorf("version %d: %v, want a PauseVersionError", PauseVersion+1, err)
	}
	unknownEnd := st
	unknownEnd.Dirs[1].End = EndError // no version-2 state holds it: encoded as -1
	unknown := unknownEnd.encode()
	for name, tc := range map[string]struct {
		b    []byte
		says string
	}{
		"version 1 (JSON)": {[]byte(`{"v":1}`), "version 123"},
		"cut short":        {enc[:len(enc)-1], "b->a: the state ends"},
		"trailing":         {append(bytes.Clone(enc), 0), "data after the last field"},
		"unknown end":      {unknown, "b->a end: 18446744073709551615: a number past the values it numbers"},
	} {
		if _, err := DecodePauseState(tc.b); err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want an error saying %q", name, err, tc.says)
		}
	}
	for name, bad := range map[string]func(*PauseState){
		"bytes do not add up":      func(s *PauseState) { s.Dirs[0].CopyBytes++ },
		"negative":                 func(s *PauseState) { s.Dirs[1].ControlRecords = -1 },
		"pending after the end":    func(s *PauseState) { s.Dirs[1].Pending = 1 },
		"an end that cannot go on": func(s *PauseState) { s.Dirs[0].End = EndError },
	} {
		s := st
		bad(&s)
		if _, err := s.Encode(); err == nil {
			t.Errorf("%s: encoded", name)
		}
		if _, err := DecodePauseState(s.encode()); err == nil {
			t.Errorf("%s: decoded", name)
		}
		if _, err := Resume(&net.TCPConn{}, &net.TCPConn{}, &Paused{State: s}, Options{}); err == nil {
			t.Errorf("%s: resumed", name)
		}
	}
}

// FuzzPauseState: no input makes DecodePauseState panic, and a state it
// accepts encodes to exactly its input.
func FuzzPauseState(f *testing.F) {
	st := PauseState{Dirs: [2]PausedDirection{{Bytes: 9, SpliceBytes: 8, CopyBytes: 1, Spliced: true, Pending: 3}, {End: EndEOF}}}
	enc, err := st.Encode()
	if err != nil {
		f.Fatal(err)
	}
	f.Add(enc)
	f.Fuzz(func(t *testing.T, b []byte) {
		st, err := DecodePauseState(b)
		if err != nil {
			return
		}
		again, err := st.Encode()
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("accepted %x, which encodes as %x, %v", b, again, err)
		}
	})
}

// TestResumeDiscard: a relay resumed with a pipe of pending bytes and never
// run (the other process kept the tunnel) releases its duplicate of the
// pipe with Discard; the caller's pipe and connections stay open.
func TestResumeDiscard(t *testing.T) {
	checkLeaks(t)
	tp := newTopology(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if _, err := w.Write(make([]byte, 1000)); err != nil {
		t.Fatal(err)
	}
	before := openFDs(t)
	var st PauseState
	st.Dirs[AToB].Pending = 1000
	tun, err := Resume(tp.relayA, tp.relayB, &Paused{State: st, Pipes: [2]*os.File{r, nil}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got := openFDs(t); got != before+1 {
		t.Fatalf("Resume took %d descriptors, want 1 (its duplicate of the pipe)", got-before)
	}
	tun.Discard()
	if got := openFDs(t); got != before {
		t.Errorf("%d descriptors left after Discard, want none", got-before)
	}
	// The caller's end still reads the pending bytes: nothing was consumed.
	if n, err := r.Read(make([]byte, 2000)); n != 1000 || err != nil {
		t.Errorf("the caller's pipe read %d bytes, %v; want the 1000 pending", n, err)
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

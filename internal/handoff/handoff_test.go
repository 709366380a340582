package handoff

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/fdpass"
)

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// checkFDs fails t if it ends with more descriptors open than it began.
func checkFDs(t *testing.T) {
	before := openFDs(t)
	t.Cleanup(func() {
		// Sockets close asynchronously in the poller; give them a moment.
		for range 100 {
			if openFDs(t) <= before {
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Errorf("%d descriptors open at the end, %d at the start", openFDs(t), before)
	})
}

// listen returns a socket a Sender accepts on, closed when t ends, and its
// path.
func listen(t *testing.T) (string, *net.UnixListener) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "handoff.sock")
	ln, err := Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return path, ln
}

// session returns a connected sender and receiver with cfgs.
func session(t *testing.T, send, recv Config) (*Sender, *Receiver) {
	t.Helper()
	path, ln := listen(t)
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v (%v), want 0600", fi.Mode().Perm(), err)
	}
	type accepted struct {
		s   *Sender
		err error
	}
	ch := make(chan accepted, 1)
	go func() {
		s, err := Accept(ln, send)
		ch <- accepted{s, err}
	}()
	r, err := Dial(path, recv)
	a := <-ch
	if err != nil || a.err != nil {
		t.Fatalf("dial: %v; accept: %v", err, a.err)
	}
	t.Cleanup(func() { a.s.Close(); r.Close() })
	return a.s, r
}

// pipeObject is a test object: the write end of a pipe travels, the test
// reads what arrives at the read end.
func pipeObject(t *testing.T) (read, write *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close(); w.Close() })
	return r, w
}

// Objects move one after another, a state far above one message's size
// exact, their descriptors usable on the receiving side; the session
// ends with ErrDone and leaves no descriptor open.
func TestMoveObjects(t *testing.T) {
	checkFDs(t)
	s, r := session(t, Config{Build: "old", Want: "ignored"}, Config{Build: "new", Want: "objects"})
	if s.Peer().Build != "new" || s.Peer().Want != "objects" || r.Peer().Build != "old" || r.Peer().Want != "" || r.Peer().PID != os.Getpid() {
		t.Fatalf("hellos: sender saw %+v, receiver %+v", s.Peer(), r.Peer())
	}
	big := make([]byte, 5*chunk+123)
	rand.Read(big)
	states := [][]byte{[]byte("small"), big, nil}
	done := make(chan error, 1)
	go func() {
		for i := range states {
			it, err := r.Next()
			if err != nil {
				done <- err
				return
			}
			if it.Kind != uint16(10+i) || !bytes.Equal(it.State, states[i]) || len(it.Files) != 1 {
				done <- fmt.Errorf("object %d: kind %d, %d state bytes, %d files", i, it.Kind, len(it.State), len(it.Files))
				return
			}
			if err := it.Adopt(); err != nil {
				done <- err
				return
			}
			fmt.Fprintf(it.Files[0], "from the receiver %d", i)
			it.Files[0].Close()
		}
		_, err := r.Next()
		done <- err
	}()
	for i, st := range states {
		rd, wr := pipeObject(t)
		fate, err := s.Move(uint16(10+i), st, wr)
		if fate != Moved || err != nil {
			t.Fatalf("object %d: %v, %v", i, fate, err)
		}
		wr.Close() // moved: the sender's copy goes
		got, _ := io.ReadAll(rd)
		if want := fmt.Sprintf("from the receiver %d", i); string(got) != want {
			t.Fatalf("object %d: read %q through the moved descriptor, want %q", i, got, want)
		}
	}
	if err := s.Finish(); err != nil {
		t.Fatalf("finish: %v, want the receiver's answer", err)
	}
	if err := <-done; !errors.Is(err, ErrDone) {
		t.Fatalf("receiver: %v, want ErrDone", err)
	}
}

// A refused object stays the sender's, and the session goes on.
func TestMoveRefused(t *testing.T) {
	checkFDs(t)
	s, r := session(t, Config{}, Config{})
	done := make(chan struct{})
	defer func() { <-done }()
	go func() {
		defer close(done)
		it, _ := r.Next()
		it.Refuse("kind 7 unknown to this build")
		it, _ = r.Next()
		it.Adopt()
		it.Files[0].Close()
	}()
	_, wr := pipeObject(t)
	fate, err := s.Move(7, nil, wr)
	var re *RefusedError
	if fate != Kept || !errors.As(err, &re) || re.Reason != "kind 7 unknown to this build" {
		t.Fatalf("refused object: %v, %v", fate, err)
	}
	if fate, err := s.Move(8, nil, wr); fate != Moved || err != nil {
		t.Fatalf("the next object: %v, %v", fate, err)
	}
}

// A sender whose wait for the answer runs out keeps the object; the
// receiver that adopts it afterwards learns so, and must not start it.
func TestSenderKeepsAfterTimeout(t *testing.T) {
	checkFDs(t)
	s, r := session(t, Config{Timeout: 100 * time.Millisecond}, Config{})
	items := make(chan *Item, 1)
	go func() {
		it, err := r.Next()
		if err != nil {
			t.Error(err)
		}
		items <- it
	}()
	_, wr := pipeObject(t)
	fate, err := s.Move(1, []byte("x"), wr)
	if fate != Kept || err == nil {
		t.Fatalf("no answer within the timeout: %v, %v; want kept", fate, err)
	}
	it := <-items
	defer it.Files[0].Close()
	if err := it.Adopt(); !errors.Is(err, ErrKept) {
		t.Fatalf("adopting after the sender kept it: %v, want ErrKept", err)
	}
	if fate, err := s.Move(2, nil, wr); fate != Kept || !errors.Is(err, ErrBroken) {
		t.Fatalf("a Move after the session broke: %v, %v", fate, err)
	}
}

// A receiver that goes away before answering leaves the object with the
// sender.
func TestReceiverGoneBeforeAnswer(t *testing.T) {
	checkFDs(t)
	s, r := session(t, Config{}, Config{})
	done := make(chan struct{})
	defer func() { <-done }()
	go func() {
		defer close(done)
		it, _ := r.Next()
		it.Files[0].Close()
		r.c.Close() // as a process that exits
	}()
	_, wr := pipeObject(t)
	if fate, err := s.Move(1, nil, wr); fate != Kept || err == nil {
		t.Fatalf("receiver gone: %v, %v; want kept", fate, err)
	}
}

// Either side refuses a peer its Compatible rejects, and says why.
func TestIncompatiblePeer(t *testing.T) {
	checkFDs(t)
	path, ln := listen(t)
	errc := make(chan error, 1)
	go func() {
		_, err := Accept(ln, Config{Build: "v1.2.0", Compatible: func(p Hello) error {
			return fmt.Errorf("build %s cannot take tunnels from %s", p.Build, "v1.2.0")
		}})
		errc <- err
	}()
	_, err := Dial(path, Config{Build: "v2.0.0"})
	var re *RefusedError
	if !errors.As(err, &re) || re.Reason != "build v2.0.0 cannot take tunnels from v1.2.0" {
		t.Fatalf("dial to a sender that refuses this build: %v", err)
	}
	if err := <-errc; err == nil {
		t.Fatal("the sender accepted a peer it refused")
	}
}

// The sender's side of the fault tests, in a process of its own: it
// offers one object and then, as HANDOFF_CHILD says, dies without
// releasing it, or closes the session without a word and lives on.
func TestMain(m *testing.M) {
	if mode := os.Getenv("HANDOFF_CHILD"); mode != "" {
		os.Exit(child(mode, os.Getenv("HANDOFF_PATH")))
	}
	os.Exit(m.Run())
}

func child(mode, path string) int {
	if mode == "receive-die" || mode == "receive-close" {
		return receiverChild(mode, path)
	}
	ln, err := Listen(path)
	if err != nil {
		return 2
	}
	os.WriteFile(path+".ready", nil, 0o600)
	s, err := accept(ln, Config{}) // this side reads the answers itself
	if err != nil {
		return 2
	}
	_, wr, _ := os.Pipe()
	item := []byte{0, 1, 0, 0, 0, 0, 0, 0, 0, 1}
	if fdpass.Send(s.c, kindItem, item, wr) != nil {
		return 2
	}
	if mode == "two-die" { // a second object in flight
		_, wr2, _ := os.Pipe()
		if fdpass.Send(s.c, kindItem, []byte{0, 1, 0, 0, 0, 0, 0, 0, 0, 2}, wr2) != nil {
			return 2
		}
	}
	if m, err := fdpass.Receive(s.c, fdpass.Limits{}); err != nil || m.Kind != kindAdopted {
		return 2
	}
	if mode == "die" || mode == "two-die" {
		os.Exit(3) // ADOPTED read, RELEASED never sent
	}
	s.c.Close() // "close": ends the session without RELEASED or KEEP, and lives
	time.Sleep(time.Minute)
	return 0
}

// startChild runs child(mode) and returns its socket's path.
func startChild(t *testing.T, mode string) (string, *exec.Cmd) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "handoff.sock")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "HANDOFF_CHILD="+mode, "HANDOFF_PATH="+path)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(path + ".ready"); err == nil {
			return path, cmd
		}
		if time.Now().After(deadline) {
			t.Fatal("the sender process did not listen")
		}
	}
}

// adoptFromChild dials the sender child(mode), takes its one object and
// returns what Adopt said.
func adoptFromChild(t *testing.T, mode string, cfg Config) (*exec.Cmd, error) {
	t.Helper()
	path, cmd := startChild(t, mode)
	r, err := Dial(path, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	it, err := r.Next()
	if err != nil {
		t.Fatal(err)
	}
	defer it.Files[0].Close()
	return cmd, it.Adopt()
}

// The sender dies after the receiver adopted an object and before it was
// released: its copy died with it, so the receiver starts the object.
func TestSenderDiedAfterAdopted(t *testing.T) {
	cmd, err := adoptFromChild(t, "die", Config{})
	if err != nil {
		t.Fatalf("the sender died before releasing: %v, want nil (start it)", err)
	}
	if err := cmd.Wait(); cmd.ProcessState == nil || cmd.ProcessState.ExitCode() != 3 {
		t.Fatalf("the sender exited %v (%v), want 3: it did not die where the test says", cmd.ProcessState, err)
	}
}

// The sender dies after the receiver adopted one object and before its
// answer to a second, which therefore fails (EPIPE): the first object,
// whose copy died with the sender, is started, not dropped for the failed
// answer; the second stays the sender's, as every object it was never told
// of.
func TestSenderDiedWhileAnswering(t *testing.T) {
	// One CPU: the answers go on the reading goroutine, which reads
	// nothing of the sender's end meanwhile.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	path, cmd := startChild(t, "two-die")
	r, err := Dial(path, Config{Window: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var started, dropped bool
	var secondErr error
	err = r.Take(func(it *Item) {
		defer it.Close()
		if it.id == 1 {
			if err := it.AdoptThen(func() { started = true }, func() { dropped = true }); err != nil {
				t.Errorf("object 1: %v", err)
			}
			return
		}
		cmd.Wait() // the sender read the first ADOPTED and died
		secondErr = it.AdoptThen(func() { t.Error("object 2 started") }, func() { t.Error("object 2 dropped by a verdict") })
	})
	if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() != 3 {
		t.Fatalf("the sender exited %v, want 3: it did not die where the test says", cmd.ProcessState)
	}
	if !errors.Is(secondErr, unix.EPIPE) || !errors.Is(err, unix.EPIPE) {
		t.Fatalf("object 2's answer: %v; Take: %v; want both to name EPIPE", secondErr, err)
	}
	if !started || dropped {
		t.Fatalf("object 1: started %v, dropped %v; want it started: the sender died with its copy", started, dropped)
	}
}

// A sender that ends the session without a verdict and lives may still
// use the object: the receiver closes its copy (never two in use).
func TestSenderAliveClosedWithoutVerdict(t *testing.T) {
	cmd, err := adoptFromChild(t, "close", Config{Timeout: 300 * time.Millisecond})
	if !errors.Is(err, ErrKept) {
		t.Fatalf("a live sender ended the session before releasing: %v, want ErrKept", err)
	}
	if cmd.ProcessState != nil {
		t.Fatal("the sender had exited: the test proves nothing")
	}
}

// The receiver's side of the fault tests: it takes one object, then, as
// HANDOFF_CHILD says, dies ("receive-die") or ends the session and lives
// ("receive-close"), without answering the sender's DONE.
func receiverChild(mode, path string) int {
	r, err := Dial(path, Config{})
	if err != nil {
		return 2
	}
	it, err := r.Next()
	if err != nil || it.Adopt() != nil {
		return 2
	}
	if mode == "receive-die" {
		os.Exit(3)
	}
	r.c.Close()
	time.Sleep(time.Minute)
	return 0
}

// finishWithChild moves one object to the receiver child(mode) and
// returns the session, once the child did what its mode says.
func finishWithChild(t *testing.T, mode string, cfg Config) (*Sender, *exec.Cmd) {
	t.Helper()
	path, ln := listen(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "HANDOFF_CHILD="+mode, "HANDOFF_PATH="+path)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	s, err := Accept(ln, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	_, wr := pipeObject(t)
	if fate, err := s.Move(1, []byte("x"), wr); fate != Moved {
		t.Fatalf("the object: %v, %v", fate, err)
	}
	// The child has answered RELEASED's read by now or soon; its end of
	// the session is what Finish meets.
	if mode == "receive-die" {
		cmd.Wait()
		if cmd.ProcessState.ExitCode() != 3 {
			t.Fatalf("the receiver exited %v: it did not die where the test says", cmd.ProcessState)
		}
	} else {
		select {
		case <-s.readEnd:
		case <-time.After(10 * time.Second):
			t.Fatal("the receiver did not end the session")
		}
		if !errors.Is(s.readErr, io.EOF) {
			t.Fatalf("the receiver's end of the session read as %v, want EOF alone", s.readErr)
		}
	}
	return s, cmd
}

// A receiver that died before answering DONE: Finish fails and PeerDied
// says the receiver is gone with what it took.
func TestFinishReceiverDied(t *testing.T) {
	s, _ := finishWithChild(t, "receive-die", Config{})
	if err := s.Finish(); err == nil {
		t.Fatal("finish with a dead receiver: nil, want an error")
	}
	if !s.PeerDied() {
		t.Fatal("PeerDied: false for a receiver that exited")
	}
}

// A receiver that ended the session without answering DONE and lives:
// Finish fails and PeerDied says it lives on (with what it took).
func TestFinishReceiverAlive(t *testing.T) {
	s, cmd := finishWithChild(t, "receive-close", Config{Timeout: 300 * time.Millisecond})
	if err := s.Finish(); err == nil {
		t.Fatal("finish with a receiver that closed the session: nil, want an error")
	}
	if s.PeerDied() {
		t.Fatal("PeerDied: true for a receiver that lives")
	}
	if cmd.ProcessState != nil {
		t.Fatal("the receiver had exited: the test proves nothing")
	}
}

// Objects offered from several goroutines are in flight together, up to
// the session's window: the receiver reads a window's worth of offers
// before it adopts any, adopts them without waiting (AdoptThen), and every
// object arrives whole, its descriptor usable, its verdict acted on by
// the time Next says the session is done.
func TestMoveInFlight(t *testing.T) {
	checkFDs(t)
	const window, objects = 4, 64
	s, r := session(t, Config{Window: 8}, Config{Window: window})
	if s.Window() != window || r.Peer().Window != 8 || s.Peer().Window != window {
		t.Fatalf("window %d (hellos %d, %d), want the smaller side's %d", s.Window(), r.Peer().Window, s.Peer().Window, window)
	}
	started := map[uint16]int{}
	done := make(chan error, 1)
	go func() {
		var offers []*Item
		for len(offers) < window { // every one offered before any answer
			it, err := r.Next()
			if err != nil {
				done <- err
				return
			}
			offers = append(offers, it)
		}
		adopt := func(it *Item) error {
			return it.AdoptThen(func() {
				started[it.Kind]++
				fmt.Fprintf(it.Files[0], "object %d", it.Kind)
				it.Close()
			}, func() {
				t.Errorf("object %d kept", it.Kind)
				it.Close()
			})
		}
		for _, it := range offers {
			if err := adopt(it); err != nil {
				done <- err
				return
			}
		}
		for {
			it, err := r.Next()
			if err != nil {
				done <- err
				return
			}
			if err := adopt(it); err != nil {
				done <- err
				return
			}
		}
	}()
	moveFromGoroutines(t, s, objects)
	if err := <-done; !errors.Is(err, ErrDone) {
		t.Fatalf("receiver: %v, want ErrDone", err)
	}
	if len(started) != objects {
		t.Fatalf("%d objects started, want %d", len(started), objects)
	}
	for k, n := range started {
		if n != 1 {
			t.Fatalf("object %d started %d times", k, n)
		}
	}
}

// moveFromGoroutines moves objects 0 to n-1, each from a goroutine of its
// own with a pipe's write end, and fails t unless each moved and what the
// receiver wrote through it ("object <kind>") arrived; then it finishes
// the session.
func moveFromGoroutines(t *testing.T, s *Sender, n int) {
	t.Helper()
	fates := make(chan error, n)
	for i := range n {
		go func() {
			rd, wr := pipeObject(t)
			fate, err := s.Move(uint16(i), []byte(fmt.Sprint(i)), wr)
			if fate != Moved {
				fates <- fmt.Errorf("object %d: %v, %v", i, fate, err)
				return
			}
			wr.Close()
			got, _ := io.ReadAll(rd)
			if want := fmt.Sprintf("object %d", i); string(got) != want {
				fates <- fmt.Errorf("object %d: read %q through the moved descriptor, want %q", i, got, want)
				return
			}
			fates <- nil
		}()
	}
	for range n {
		if err := <-fates; err != nil {
			t.Error(err)
		}
	}
	if err := s.Finish(); err != nil {
		t.Fatalf("finish: %v", err)
	}
}

// A sender whose session fails with objects in flight keeps every one it
// did not release, and the receiver starts exactly the ones it did.
func TestInFlightFailureAgrees(t *testing.T) {
	checkFDs(t)
	s, r := session(t, Config{Timeout: 200 * time.Millisecond, Window: 4}, Config{Window: 4})
	const objects = 3
	type verdict struct {
		kind    uint16
		started *bool // nil: none given
	}
	verdicts := make(chan verdict, 1)
	go func() {
		var got verdict
		var offers []*Item
		for range objects {
			it, err := r.Next()
			if err != nil {
				t.Error(err)
				verdicts <- got
				return
			}
			offers = append(offers, it)
		}
		// The first is adopted; the others never answered: the
		// sender's wait for them runs out.
		it := offers[0]
		got.kind = it.Kind
		it.AdoptThen(func() { got.started = new(true) }, func() { got.started = new(false) })
		for _, o := range offers {
			o.Close()
		}
		_, err := r.Next()
		if err == nil || errors.Is(err, ErrDone) {
			t.Errorf("the session after the sender failed: %v, want its failure", err)
		}
		verdicts <- got
	}()
	fates := make(chan Fate, objects)
	for i := range objects {
		go func() {
			_, wr := pipeObject(t)
			fate, _ := s.Move(uint16(i), nil, wr)
			fates <- fate
		}()
	}
	moved := 0
	for range objects {
		if <-fates == Moved {
			moved++
		}
	}
	got := <-verdicts
	if got.started == nil {
		t.Fatal("the adopted object had no verdict when the session ended")
	}
	if *got.started != (moved == 1) || moved > 1 {
		t.Fatalf("object %d: started here %v, %d moved for the sender: one copy must be in use", got.kind, *got.started, moved)
	}
	if fate, err := s.Move(9, nil); fate != Kept || !errors.Is(err, ErrBroken) {
		t.Fatalf("a Move after the session failed: %v, %v", fate, err)
	}
}

// A sender that closes with answers of its receiver unread resets the
// receiver's end: the kernel reports ECONNRESET before the messages the
// sender queued, a RELEASED among them. The receiver still reads it and
// starts that object; the one without a verdict, from a sender that lives,
// is closed.
func TestReleasedBeforeResetIsRead(t *testing.T) {
	checkFDs(t)
	path, ln := listen(t)
	sc := make(chan *Sender, 1)
	go func() {
		s, err := accept(ln, Config{}) // this side reads the answers itself
		if err != nil {
			t.Error(err)
		}
		sc <- s
	}()
	r, err := Dial(path, Config{Timeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	s := <-sc
	defer unix.Close(s.pidfd)
	for id := uint64(1); id <= 2; id++ {
		_, wr := pipeObject(t)
		item := binary.BigEndian.AppendUint64([]byte{0, byte(id)}, id)
		if err := fdpass.Send(s.c, kindItem, item, wr); err != nil {
			t.Fatal(err)
		}
	}
	got := map[uint16]bool{}
	for range 2 {
		it, err := r.Next()
		if err != nil {
			t.Fatal(err)
		}
		it.AdoptThen(func() { got[it.Kind] = true }, func() { got[it.Kind] = false })
		it.Close()
	}
	if m, err := fdpass.Receive(s.c, fdpass.Limits{}); err != nil || m.Kind != kindAdopted {
		t.Fatalf("the first answer: %v, %v", m, err)
	}
	if err := fdpass.Send(s.c, kindReleased, idPayload(1, "")); err != nil {
		t.Fatal(err)
	}
	s.c.Close() // the second ADOPTED unread: the receiver's end is reset
	if _, err := r.Next(); err == nil {
		t.Fatal("Next after the sender closed: nil error")
	}
	if want := map[uint16]bool{1: true, 2: false}; !maps.Equal(got, want) {
		t.Fatalf("verdicts %v, want %v (the released one started, the other closed)", got, want)
	}
}

type windowMover int

func (windowMover) Move(uint16, []byte, ...syscall.Conn) (bool, error) { return true, nil }
func (w windowMover) Window() int                                      { return int(w) }

// each offers every object once, with as many calls at once as the
// mover's window, and no more.
func TestEachWindow(t *testing.T) {
	for _, window := range []int{0, 1, 3} {
		objects := make([]int, 50)
		for i := range objects {
			objects[i] = i
		}
		var mu sync.Mutex
		seen := map[int]int{}
		now, most := 0, 0
		gate := make(chan struct{})
		go func() {
			for range 10 { // until every call that can be in flight is
				time.Sleep(5 * time.Millisecond)
			}
			close(gate)
		}()
		each(windowMover(window), objects, func(o int) {
			mu.Lock()
			seen[o]++
			now++
			most = max(most, now)
			mu.Unlock()
			<-gate
			mu.Lock()
			now--
			mu.Unlock()
		})
		if want := max(window, 1); most != want {
			t.Errorf("window %d: %d calls at once, want %d", window, most, want)
		}
		for _, o := range objects {
			if seen[o] != 1 {
				t.Errorf("window %d: object %d offered %d times", window, o, seen[o])
			}
		}
	}
}

// MoveAll counts each object once: moved with its pause (none for an
// object that stood still for nothing), stayed by why under its name, or
// skipped and not counted.
func TestMoveAll(t *testing.T) {
	outcomes := map[int]Offered{
		1: {Pause: time.Millisecond},
		2: {},
		3: {Why: StayRefused, Err: errors.New("refused")},
		4: {Why: StayPause, Err: errors.New("busy")},
		5: {Skipped: true},
		6: {Why: StayRefused, Err: errors.New("refused")},
	}
	res := MoveAll(windowMover(3), []int{1, 2, 3, 4, 5, 6}, func(o int) string { return fmt.Sprint("object ", o) },
		func(o int) Offered { return outcomes[o] })
	if res.Moved != 2 || !slices.Equal(res.Pauses, []time.Duration{time.Millisecond}) {
		t.Errorf("moved %d, pauses %v; want 2, and the one pause", res.Moved, res.Pauses)
	}
	if !maps.Equal(res.Stayed, map[string]int{StayRefused: 2, StayPause: 1}) || len(res.Stays) != 3 {
		t.Errorf("stayed %v (%d stays); want 2 refused and 1 pause", res.Stayed, len(res.Stays))
	}
	for _, st := range res.Stays {
		if st.Object == "object 4" && (st.Why != StayPause || st.Err.Error() != "busy") {
			t.Errorf("object 4 stays as %+v", st)
		}
	}
}

// Take builds a window's objects at once, and no more than the process
// has CPUs: every take of a group is in progress before any answers, the
// answers go back in the reverse order of the offers, and every object
// arrives whole, its descriptor usable, its verdict acted on by the time
// Take returns ErrDone. With one CPU it builds one at a time.
func TestTakeBuildsAtOnce(t *testing.T) {
	for _, c := range []struct{ procs, builders int }{{8, 4}, {2, 2}, {1, 1}} {
		t.Run(fmt.Sprintf("GOMAXPROCS=%d", c.procs), func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(c.procs))
			takeBuildsAtOnce(t, c.builders)
		})
	}
}

func takeBuildsAtOnce(t *testing.T, builders int) {
	checkFDs(t)
	const window, objects = 4, 64
	s, r := session(t, Config{Window: window}, Config{Window: window})
	var mu sync.Mutex
	started := map[uint16]int{}
	var building, most int
	// gates holds each take of the current group until the group is
	// complete, then lets the last offer answer first.
	gates := make(chan chan struct{}, builders)
	take := func(it *Item) {
		mu.Lock()
		building++
		most = max(most, building)
		mu.Unlock()
		gate := make(chan struct{})
		gates <- gate
		select {
		case <-gate:
		case <-time.After(time.Minute):
			t.Errorf("object %d: the group's other objects were not built at once", it.Kind)
		}
		mu.Lock()
		building--
		mu.Unlock()
		err := it.AdoptThen(func() {
			mu.Lock()
			started[it.Kind]++
			mu.Unlock()
			fmt.Fprintf(it.Files[0], "object %d", it.Kind)
			it.Close()
		}, func() {
			t.Errorf("object %d kept", it.Kind)
			it.Close()
		})
		if err != nil {
			t.Errorf("object %d: %v", it.Kind, err)
		}
	}
	go func() { // opens each group's gates, the last one first
		for range objects / builders {
			var held []chan struct{}
			for range builders {
				held = append(held, <-gates)
			}
			for i := len(held) - 1; i >= 0; i-- {
				close(held[i])
			}
		}
	}()
	done := make(chan error, 1)
	go func() { done <- r.Take(take) }()
	moveFromGoroutines(t, s, objects)
	if err := <-done; !errors.Is(err, ErrDone) {
		t.Fatalf("Take: %v, want ErrDone", err)
	}
	if len(started) != objects || most != builders {
		t.Fatalf("%d objects started, at most %d built at once; want %d and %d", len(started), most, objects, builders)
	}
	for k, n := range started {
		if n != 1 {
			t.Errorf("object %d started %d times", k, n)
		}
	}
}

// An answer that fails on a take's goroutine ends the session at once,
// named by that failure, while the reading goroutine waits for a message:
// the object whose answer failed stays the sender's (AdoptThen says so and
// calls neither of its functions), one released before is started, and
// the sender keeps what it never released.
func TestTakeAnswerFails(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(2)) // takes on goroutines of their own
	checkFDs(t)
	s, r := session(t, Config{Window: 2, Timeout: 500 * time.Millisecond}, Config{Window: 2})
	first := make(chan struct{})
	var startedFirst bool
	var secondErr error
	take := func(it *Item) {
		switch it.Kind {
		case 1:
			if err := it.AdoptThen(func() { startedFirst = true; it.Close() }, func() { t.Error("object 1 kept"); it.Close() }); err != nil {
				t.Errorf("object 1: %v", err)
			}
		case 2:
			<-first // object 1 moved; the reader waits for a message
			r.c.CloseWrite()
			secondErr = it.AdoptThen(func() { t.Error("object 2 started") }, func() { t.Error("object 2 dropped by a verdict") })
			it.Close()
		}
	}
	done := make(chan error, 1)
	go func() { done <- r.Take(take) }()
	_, w1 := pipeObject(t)
	if fate, err := s.Move(1, nil, w1); fate != Moved {
		t.Fatalf("object 1: %v, %v", fate, err)
	}
	close(first)
	_, w2 := pipeObject(t)
	fate, err := s.Move(2, nil, w2)
	if fate != Kept {
		t.Fatalf("object 2: %v (%v), want it kept", fate, err)
	}
	err = <-done
	// Whichever failure this side meets first ends the session: its own
	// answer's (EPIPE), or the sender's KEEP, sent once its wait for that
	// answer met the half-close (EOF), which may also reach object 2's
	// AdoptThen before its answer is written. Either names the failed
	// answer; object 2 is kept either way.
	namesFailedAnswer := func(err error) bool {
		return errors.Is(err, unix.EPIPE) ||
			errors.Is(err, ErrKept) && strings.Contains(err.Error(), "object 2: waiting for the receiver's answer")
	}
	if !namesFailedAnswer(err) || !errors.Is(secondErr, ErrKept) || !namesFailedAnswer(secondErr) {
		t.Fatalf("Take: %v; object 2's AdoptThen: %v; want both to name the failed answer (EPIPE, or the sender keeping object 2 for want of it), the object kept", err, secondErr)
	}
	if !startedFirst {
		t.Fatal("object 1, released before the failure, was not started")
	}
}

package ktls

import (
	"errors"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// partialReader is an rxReader over the accepted end of a loopback TCP
// pair whose peer (returned last) has sent queuedBytes that nobody reads: a
// reader that finds no record ready with part of one queued.
func partialReader(t *testing.T, queuedBytes int) (*rxReader, *readDeadline, *net.TCPConn, net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	peer, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.Close() })
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	sock := c.(*net.TCPConn)
	t.Cleanup(func() { sock.Close() })
	if queuedBytes > 0 {
		if _, err := peer.Write(make([]byte, queuedBytes)); err != nil {
			t.Fatal(err)
		}
		fd := kerneltest.SocketFD(t, sock)
		for deadline := time.Now().Add(5 * time.Second); kerneltest.Inq(t, fd) == 0; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the peer's bytes never reached the receive queue")
			}
		}
	}
	rd := &readDeadline{}
	rd.setSock(sock)
	rc, err := sock.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return newRXReader(rd, rc), rd, sock, peer
}

// readyAfter returns a read callback that finds a record only once r was
// woken retries times in a row (0: never), and the count of its calls.
// The callback may also be called on wake-ups the netpoller gives for an
// old readiness.
func readyAfter(r *rxReader, retries int32) (func(fd uintptr) bool, *atomic.Int32) {
	var n atomic.Int32
	return func(uintptr) bool {
		n.Add(1)
		return retries > 0 && r.retries.Load() >= retries
	}, &n
}

// goRead starts r.Read(f); its error comes on the channel.
func goRead(r *rxReader, f func(fd uintptr) bool) <-chan error {
	done := make(chan error, 1)
	go func() { done <- r.Read(f) }()
	return done
}

// awaitRead returns the error of the Read behind done, failing t with
// stuck when it has not returned within 10 s.
func awaitRead(t *testing.T, done <-chan error, stuck string) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal(stuck)
		return nil
	}
}

// readToCallerDeadline runs a Read that finds no record, with queued bytes
// queued and the caller's deadline after from now. It fails t unless the
// caller's deadline ended it with no retry counted, and returns the count
// of the callback's calls.
func readToCallerDeadline(t *testing.T, queued int, after time.Duration) int32 {
	t.Helper()
	r, rd, sock, _ := partialReader(t, queued)
	rd.set(time.Now().Add(after), sock.SetReadDeadline)
	f, calls := readyAfter(r, 0)
	before := Stats().PartialRecordRetries
	err := awaitRead(t, goRead(r, f), "Read still waiting after 10 s")
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read: %v, want the caller's deadline", err)
	}
	if got := Stats().PartialRecordRetries - before; got != 0 {
		t.Errorf("PartialRecordRetries moved by %d, want 0", got)
	}
	return calls.Load()
}

// TestRXReaderAsksAgainWithBytesQueued: a reader that finds no record while
// bytes are queued is woken to ask again once it has waited its bound
// (250 ms, then 500 ms), with no readability event, and each such retry
// is counted.
func TestRXReaderAsksAgainWithBytesQueued(t *testing.T) {
	r, rd, _, _ := partialReader(t, 100)
	f, calls := readyAfter(r, 2)
	before := Stats().PartialRecordRetries
	start := time.Now()
	if err := awaitRead(t, goRead(r, f), "Read still waiting after 10 s"); err != nil {
		t.Fatalf("Read: %v", err)
	}
	if got := calls.Load(); got < 3 {
		t.Errorf("the callback ran %d times, want 3 or more", got)
	}
	// The bounds double: 250 ms, then 500 ms.
	if took := time.Since(start); took < partialRecordRetry*3 {
		t.Errorf("two bounded waits took %v, less than their bounds (%v)", took, partialRecordRetry*3)
	}
	if got := Stats().PartialRecordRetries - before; got != 2 {
		t.Errorf("PartialRecordRetries moved by %d, want 2", got)
	}
	if rd.poked.Load() || r.retries.Load() != 0 {
		t.Errorf("after a read that found its record: poked %v, retries %d; want false, 0", rd.poked.Load(), r.retries.Load())
	}
}

// TestRXReaderRecordAfterRetry: a record that arrives after a retry ends
// the wait as readability does, and the next wait's bound starts from
// partialRecordRetry again, not from where the retries had doubled it.
func TestRXReaderRecordAfterRetry(t *testing.T) {
	r, _, _, peer := partialReader(t, 100)
	// Ready once more than the first 100 bytes are queued.
	f := func(fd uintptr) bool {
		n, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ)
		return err == nil && n > 100
	}
	done := goRead(r, f)
	for deadline := time.Now().Add(5 * time.Second); r.retries.Load() < 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the reader never asked again")
		}
	}
	waitParked(t, r)
	if _, err := peer.Write([]byte{1}); err != nil {
		t.Fatal(err)
	}
	if err := awaitRead(t, done, "the arriving byte did not end the wait"); err != nil {
		t.Fatalf("Read: %v", err)
	}
	if got := r.retries.Load(); got != 0 {
		t.Errorf("retries %d after the wait ended by readability, want 0", got)
	}
}

// TestRXReaderIdleWaitUnbounded: a reader that waits with nothing queued
// is never woken (no retry counted, the callback run once): it waits for
// readability alone, until the caller's deadline.
func TestRXReaderIdleWaitUnbounded(t *testing.T) {
	// Nothing is queued, so no readiness wakes it either.
	if got := readToCallerDeadline(t, 0, 900*time.Millisecond); got != 1 {
		t.Errorf("the callback ran %d times, want 1", got)
	}
}

// TestRXReaderCallerDeadlineFirst: a caller's deadline before the bound
// ends the wait as the caller's, not as a retry.
func TestRXReaderCallerDeadlineFirst(t *testing.T) {
	readToCallerDeadline(t, 100, 100*time.Millisecond)
}

// TestRXReaderCallerDeadlineWhileWaiting: a caller's later deadline set
// while the reader waits leaves the retry in force, and a caller's past
// one ends the wait as the caller's.
func TestRXReaderCallerDeadlineWhileWaiting(t *testing.T) {
	t.Run("later", func(t *testing.T) {
		r, rd, sock, _ := partialReader(t, 100)
		f, _ := readyAfter(r, 1)
		done := goRead(r, f)
		waitParked(t, r)
		if err := rd.set(time.Now().Add(time.Minute), sock.SetReadDeadline); err != nil {
			t.Fatal(err)
		}
		if err := awaitRead(t, done, "the caller's deadline stopped the retry: the reader never asked again"); err != nil {
			t.Fatalf("Read: %v", err)
		}
		if rd.poked.Load() {
			t.Error("still poked")
		}
	})
	t.Run("past", func(t *testing.T) {
		r, rd, sock, _ := partialReader(t, 100)
		f, _ := readyAfter(r, 0)
		done := goRead(r, f)
		waitParked(t, r)
		if err := rd.set(time.Unix(1, 0), sock.SetReadDeadline); err != nil {
			t.Fatal(err)
		}
		if err := awaitRead(t, done, "a past deadline did not end the wait"); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("Read: %v, want the caller's deadline", err)
		}
	})
}

// TestRXReaderClosedLeavesSweeper: the sweeper drops the readers of closed
// sockets, and ends when none is left.
func TestRXReaderClosedLeavesSweeper(t *testing.T) {
	r, _, sock, _ := partialReader(t, 100)
	f, _ := readyAfter(r, 0)
	done := goRead(r, f)
	waitParked(t, r)
	sock.Close()
	if err := awaitRead(t, done, "Read on a closed socket still waiting after 10 s"); err == nil {
		t.Fatal("Read on a closed socket returned nil")
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		watched.mu.Lock()
		running, n := watched.running, len(watched.readers)
		watched.mu.Unlock()
		if !running {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sweeper still runs, %d readers watched", n)
		}
	}
}

// waitParked waits until r's Read waits in RawConn.Read.
func waitParked(t *testing.T, r *rxReader) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); r.seq.Load()%2 == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the reader never waited")
		}
	}
}

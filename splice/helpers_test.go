package splice

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

const MiB = 1 << 20

// checkLeaks fails t when, after the test's own cleanups, more file
// descriptors or goroutines exist than before it. Register it first so that
// it runs last.
func checkLeaks(t *testing.T) {
	t.Helper()
	netpollOnce.Do(startNetpoll)
	fds := kerneltest.OpenFDs(t)
	goroutines := runtime.NumGoroutine()
	t.Cleanup(func() {
		var nowFDs, nowG int
		for deadline := time.Now().Add(5 * time.Second); ; {
			nowFDs, nowG = kerneltest.OpenFDs(t), runtime.NumGoroutine()
			if (nowFDs <= fds && nowG <= goroutines) || time.Now().After(deadline) {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if nowFDs > fds {
			t.Errorf("fd leak: %d open before, %d after", fds, nowFDs)
		}
		if nowG > goroutines {
			buf := make([]byte, 1<<20)
			t.Errorf("goroutine leak: %d before, %d after\n%s", goroutines, nowG, buf[:runtime.Stack(buf, true)])
		}
	})
}

var netpollOnce sync.Once

// startNetpoll makes the runtime create its netpoller (an epoll fd and an
// eventfd, held for the life of the process) before any leak baseline.
func startNetpoll() {
	if ln, err := net.Listen("tcp", "127.0.0.1:0"); err == nil {
		ln.Close()
	}
}

// newTestPool returns a private pipe pool closed when the test ends.
func newTestPool(t *testing.T, maxIdle int) *PipePool {
	return newSizedTestPool(t, DefaultPipeSize, maxIdle)
}

// newSizedTestPool is newTestPool with pipes that ask for size bytes.
func newSizedTestPool(t *testing.T, size, maxIdle int) *PipePool {
	pool := NewPipePool(size, maxIdle)
	t.Cleanup(func() {
		if st := pool.Stats(); st.InUse != 0 {
			t.Errorf("pipes still in use at the end: %+v", st)
		}
		pool.Close()
	})
	return pool
}

// tcpPair returns the two ends of one loopback TCP connection. The test
// closes them at the end (a second Close after the relay's is harmless).
func tcpPair(t testing.TB) (dialed, accepted *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	type acc struct {
		c   *net.TCPConn
		err error
	}
	ch := make(chan acc, 1)
	go func() {
		c, err := ln.AcceptTCP()
		ch <- acc{c, err}
	}()
	d, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	a := <-ch
	if a.err != nil {
		d.Close()
		t.Fatal(a.err)
	}
	t.Cleanup(func() { d.Close(); a.c.Close() })
	return d, a.c
}

// topology is client → (relayA | tunnel | relayB) → upstream.
type topology struct {
	client, relayA, relayB, upstream *net.TCPConn
}

func newTopology(t testing.TB) topology {
	var tp topology
	tp.client, tp.relayA = tcpPair(t)
	tp.relayB, tp.upstream = tcpPair(t)
	return tp
}

// opaqueConn hides the *net.TCPConn under it so that the relay cannot splice
// it: the userspace copy fallback (as for a TLS connection kept in Go).
type opaqueConn struct{ net.Conn }

func (c opaqueConn) CloseWrite() error { return c.Conn.(*net.TCPConn).CloseWrite() }

// NetConn exposes the socket as *tls.Conn does: how a failed tunnel reaches
// the socket to reset it.
func (c opaqueConn) NetConn() net.Conn { return c.Conn }

// runRelay starts a tunnel; wait returns its outcome.
func runRelay(ctx context.Context, tun *Relay) (wait func() (Stats, error)) {
	type out struct {
		res Stats
		err error
	}
	ch := make(chan out, 1)
	go func() {
		res, err := tun.Run(ctx)
		ch <- out{res, err}
	}()
	return func() (Stats, error) {
		select {
		case o := <-ch:
			return o.res, o.err
		case <-time.After(60 * time.Second):
			return tun.Stats(), errors.New("relay did not return within 60s")
		}
	}
}

// sendStream writes n pseudo-random bytes (seeded) to w and returns their
// SHA-256.
func sendStream(w io.Writer, seed uint64, n int64) ([]byte, error) {
	h := sha256.New()
	src := io.LimitReader(rand.NewChaCha8(seedBytes(seed)), n)
	buf := make([]byte, 256<<10)
	if _, err := io.CopyBuffer(io.MultiWriter(w, h), src, buf); err != nil {
		return nil, err
	}
	return h.Sum(nil), nil
}

// goSend starts sendStream on w; sent waits for it and returns the SHA-256,
// failing the test if a write failed.
func goSend(w io.Writer, n int64, seed uint64) (sent func(t *testing.T) []byte) {
	done := make(chan struct{})
	var sum []byte
	var err error
	go func() {
		defer close(done)
		sum, err = sendStream(w, seed, n)
	}()
	return func(t *testing.T) []byte {
		t.Helper()
		<-done
		if err != nil {
			t.Fatalf("send: %v", err)
		}
		return sum
	}
}

// readExact reads exactly n bytes from r and returns their SHA-256.
func readExact(t *testing.T, r io.Reader, n int64) []byte {
	t.Helper()
	h := sha256.New()
	if _, err := io.CopyN(hashWriter{h}, r, n); err != nil {
		t.Fatalf("read %d bytes: %v", n, err)
	}
	return h.Sum(nil)
}

func seedBytes(seed uint64) (s [32]byte) {
	for i := range 8 {
		s[i] = byte(seed >> (8 * i))
	}
	return s
}

// recvStream reads r to EOF and returns the byte count and SHA-256.
func recvStream(r io.Reader) (int64, []byte, error) {
	h := sha256.New()
	n, err := io.CopyBuffer(hashWriter{h}, r, make([]byte, 256<<10))
	return n, h.Sum(nil), err
}

// hashWriter hides the hash's other methods so io.Copy uses our buffer.
type hashWriter struct{ h hash.Hash }

func (w hashWriter) Write(p []byte) (int, error) { return w.h.Write(p) }

// echoUpstream copies everything it reads back to the peer, then half-closes.
// It copies through userspace on purpose: io.Copy between TCP conns would
// splice through Go's own cached pipes, whose fds would blur the leak checks.
func echoUpstream(up *net.TCPConn) error {
	if _, err := io.CopyBuffer(struct{ io.Writer }{up}, struct{ io.Reader }{up}, make([]byte, 64<<10)); err != nil {
		return err
	}
	return up.CloseWrite()
}

// echoRun pushes size bytes through client → tunnel → echo upstream and back
// and checks both digests; it returns the tunnel's outcome.
func echoRun(ctx context.Context, tp topology, tun *Relay, seed uint64, size int64) (Stats, error) {
	wait := runRelay(ctx, tun)
	var wg sync.WaitGroup
	var upErr, sendErr error
	var sent []byte
	wg.Go(func() { upErr = echoUpstream(tp.upstream) })
	wg.Go(func() {
		sent, sendErr = sendStream(tp.client, seed, size)
		if sendErr == nil {
			sendErr = tp.client.CloseWrite()
		}
	})
	got, gotSum, recvErr := recvStream(tp.client)
	wg.Wait()
	res, relayErr := wait()
	if err := errors.Join(upErr, sendErr, recvErr, relayErr); err != nil {
		return res, err
	}
	if got != size || string(gotSum) != string(sent) {
		return res, fmt.Errorf("echo: got %d bytes sha256 %x, sent %d bytes sha256 %x", got, gotSum, size, sent)
	}
	return res, nil
}

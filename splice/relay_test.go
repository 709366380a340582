package splice

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
)

// bigTransfer is the per-direction size of the big echo tests: 64 MiB, or
// 8 MiB under the race detector.
func bigTransfer() int64 {
	if raceEnabled {
		return 8 * MiB
	}
	return 64 * MiB
}

func TestRelayEchoSplice(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 4)
	size := echoBig(t, pool, false, 1)
	st := pool.Stats()
	if st.InUse != 0 || st.Created == 0 {
		t.Errorf("pool after relay: %+v, want pipes created and none in use", st)
	}
	t.Logf("%d MiB each way; pool %+v", size/MiB, st)
}

func TestRelayEchoCopyFallback(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 4)
	echoBig(t, pool, true, 2)
	if st := pool.Stats(); st.Created != 0 {
		t.Errorf("copy path took pipes: %+v", st)
	}
}

// echoBig echoes bigTransfer() bytes (seed) each way through a tunnel with
// pipes from pool, on the copy path (relayA hidden behind opaqueConn) or
// the splice path, and checks that each direction moved them all on that
// path, ended by EOF, and reported them all to OnBytes. It returns the size.
func echoBig(t *testing.T, pool *PipePool, copyPath bool, seed uint64) int64 {
	t.Helper()
	tp := newTopology(t)
	size := bigTransfer()
	var metered [2]atomic.Int64
	tun := New(maybeOpaque(tp.relayA, copyPath), tp.relayB, Options{Pipes: pool, OnBytes: func(d Direction, n int) { metered[d].Add(int64(n)) }})
	res, err := echoRun(t.Context(), tp, tun, seed, size)
	if err != nil {
		t.Fatal(err)
	}
	spliceBytes, copyBytes, how := size, int64(0), "spliced"
	if copyPath {
		spliceBytes, copyBytes, how = 0, size, "copied"
	}
	for _, d := range []Direction{AToB, BToA} {
		ds := res.Dir(d)
		if ds.Spliced == copyPath || ds.Bytes != size || ds.SpliceBytes != spliceBytes || ds.CopyBytes != copyBytes || ds.ControlRecords != 0 || ds.End != EndEOF || ds.Err != nil {
			t.Errorf("%s: %+v, want %d bytes all %s, ended by EOF", d, ds, size, how)
		}
		if got := metered[d].Load(); got != size {
			t.Errorf("%s: OnBytes saw %d bytes, want %d", d, got, size)
		}
	}
	return size
}

// TestRelayConcurrent runs 200 tunnels at once with sizes from 0 to ~1 MiB,
// half of them with one side on the copy path, all sharing one pipe pool.
func TestRelayConcurrent(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 16)
	const tunnels = 200
	var wg sync.WaitGroup
	errs := make([]error, tunnels)
	for i := range tunnels {
		tp := newTopology(t)
		size := int64(i*i*37) % (1 * MiB)
		if i%10 == 0 {
			size = 0
		}
		var a net.Conn = tp.relayA
		copyPath := i%2 == 1
		if copyPath {
			a = opaqueConn{tp.relayA}
		}
		wg.Go(func() {
			res, err := echoRun(t.Context(), tp, New(a, tp.relayB, Options{Pipes: pool}), uint64(i), size)
			if err == nil {
				for _, d := range []Direction{AToB, BToA} {
					ds := res.Dir(d)
					if ds.Bytes != size || ds.Spliced == copyPath || ds.SpliceBytes+ds.CopyBytes != size || ds.End != EndEOF {
						err = errors.New("tunnel " + d.String() + " counters wrong")
						t.Errorf("tunnel %d (size %d, copy %v) %s: %+v", i, size, copyPath, d, ds)
					}
				}
			}
			errs[i] = err
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("tunnel %d: %v", i, err)
		}
	}
	if st := pool.Stats(); st.InUse != 0 || st.Idle > 16 {
		t.Errorf("pool after 200 tunnels: %+v", st)
	}
}

// TestRelayHalfCloseClientFirst: the client sends a request and half-closes;
// the upstream sees EOF, still sends its whole response, and the client
// gets it all.
func TestRelayHalfCloseClientFirst(t *testing.T) {
	testHalfClose(t, AToB, 300<<10, 2*MiB, 10)
}

// TestRelayHalfCloseUpstreamFirst: the upstream speaks first and half-closes;
// the client reads it all, then sends its own stream, which the upstream
// receives in full.
func TestRelayHalfCloseUpstreamFirst(t *testing.T) {
	testHalfClose(t, BToA, 1*MiB, 700<<10, 20)
}

// testHalfClose runs, on the splice and the copy path (the first sender's
// relay side hidden behind opaqueConn), a tunnel where the side that sends
// in direction first streams firstSize bytes (seed) and half-closes, which
// must end that direction only; then the other side streams secondSize bytes
// (seed+1) and half-closes, and the tunnel ends with both directions at EOF.
func testHalfClose(t *testing.T, first Direction, firstSize, secondSize int64, seed uint64) {
	second := BToA
	if first == BToA {
		second = AToB
	}
	for _, copyPath := range []bool{false, true} {
		t.Run(pathName(copyPath), func(t *testing.T) {
			checkLeaks(t)
			pool := newTestPool(t, 4)
			tp := newTopology(t)
			tun := New(maybeOpaque(tp.relayA, copyPath && first == AToB), maybeOpaque(tp.relayB, copyPath && first == BToA), Options{Pipes: pool})
			wait := runRelay(t.Context(), tun)
			// Direction AToB carries client to upstream.
			ends := map[Direction]struct {
				src, dst         *net.TCPConn
				srcName, dstName string
			}{
				AToB: {tp.client, tp.upstream, "client", "upstream"},
				BToA: {tp.upstream, tp.client, "upstream", "client"},
			}

			streamHalfClosed(t, ends[first].src, ends[first].dst, seed, firstSize, ends[first].dstName)
			// The first direction is over (it records that just after the
			// half-close the receiver saw), the other one still runs.
			if st := waitEnd(tun, first); st.Dir(first).End != EndEOF || st.Dir(second).End != EndRunning {
				t.Errorf("after the %s's half-close: %s %v, %s %v; want eof, running", ends[first].srcName, first, st.Dir(first).End, second, st.Dir(second).End)
			}
			streamHalfClosed(t, ends[second].src, ends[second].dst, seed+1, secondSize, ends[second].dstName)
			res, err := wait()
			if err != nil {
				t.Fatal(err)
			}
			if res.Dir(first).Bytes != firstSize || res.Dir(second).Bytes != secondSize || res.AToB.End != EndEOF || res.BToA.End != EndEOF {
				t.Errorf("result %+v", res)
			}
		})
	}
}

// TestRelayCloseOnEOF: with CloseOnEOF, the client's half-close ends the
// whole tunnel and the upstream sees the connection closed.
func TestRelayCloseOnEOF(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 4)
	tp := newTopology(t)
	wait := runRelay(t.Context(), New(tp.relayA, tp.relayB, Options{Pipes: pool, CloseOnEOF: true}))
	if _, err := tp.client.Write([]byte("bye")); err != nil {
		t.Fatal(err)
	}
	tp.client.CloseWrite()
	res, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	if res.AToB.End != EndEOF || res.BToA.End != EndAborted || res.AToB.Bytes != 3 {
		t.Errorf("result %+v, want a->b eof with 3 bytes, b->a aborted", res)
	}
	got, err := io.ReadAll(tp.upstream)
	if err != nil || string(got) != "bye" {
		t.Errorf("upstream read %q, %v; want \"bye\" then EOF", got, err)
	}
	if n, err := tp.client.Read(make([]byte, 1)); n != 0 || err != io.EOF {
		t.Errorf("client read after tunnel end: %d, %v; want EOF", n, err)
	}
}

// resetClose closes c with an RST instead of a FIN.
func resetClose(t *testing.T, c *net.TCPConn) {
	if err := c.SetLinger(0); err != nil {
		t.Fatal(err)
	}
	c.Close()
}

func isResetOrPipe(err error) bool {
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// checkResetResult wants the relay failed with a reset, one direction
// EndError and the other stopped.
func checkResetResult(t *testing.T, res Stats, err error) {
	t.Helper()
	if !isResetOrPipe(err) {
		t.Fatalf("relay error %v, want ECONNRESET or EPIPE", err)
	}
	errs := 0
	for _, d := range []Direction{AToB, BToA} {
		ds := res.Dir(d)
		switch ds.End {
		case EndError:
			errs++
			if ds.Err == nil {
				t.Errorf("%s ended with error but Err is nil", d)
			}
		case EndAborted, EndEOF:
		default:
			t.Errorf("%s ended %v", d, ds.End)
		}
	}
	if errs == 0 {
		t.Errorf("no direction ended in error: %+v", res)
	}
}

// resetMidStream has sender (named senderName in failures) stream far more
// than gets through, resets receiver once it has read 1 MiB, and checks that
// the relay (whose wait is given) failed with a reset and closed the
// sender's side too, so that the sender's writes fail.
func resetMidStream(t *testing.T, wait func() (Stats, error), sender, receiver *net.TCPConn, seed uint64, senderName string) Stats {
	t.Helper()
	sendDone := make(chan error, 1)
	go func() {
		_, err := sendStream(sender, seed, 1<<30) // far more than gets through
		sendDone <- err
	}()
	if _, err := io.ReadFull(receiver, make([]byte, 1*MiB)); err != nil {
		t.Fatal(err)
	}
	resetClose(t, receiver)
	res, err := wait()
	checkResetResult(t, res, err)
	select {
	case err := <-sendDone:
		if err == nil {
			t.Errorf("%s sent 1 GiB through a reset tunnel", senderName)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("%s writer still blocked 30s after the tunnel ended", senderName)
	}
	return res
}

func TestRelayUpstreamReset(t *testing.T) {
	for _, copyPath := range []bool{false, true} {
		t.Run(pathName(copyPath), func(t *testing.T) {
			checkLeaks(t)
			pool := newTestPool(t, 4)
			tp := newTopology(t)
			wait := runRelay(t.Context(), New(maybeOpaque(tp.relayA, copyPath), tp.relayB, Options{Pipes: pool}))
			res := resetMidStream(t, wait, tp.client, tp.upstream, 30, "client")
			if res.AToB.Bytes < 1*MiB {
				t.Errorf("a->b moved %d bytes, upstream read 1 MiB", res.AToB.Bytes)
			}
		})
	}
}

func TestRelayClientReset(t *testing.T) {
	for _, copyPath := range []bool{false, true} {
		t.Run(pathName(copyPath), func(t *testing.T) {
			checkLeaks(t)
			pool := newTestPool(t, 4)
			tp := newTopology(t)
			wait := runRelay(t.Context(), New(maybeOpaque(tp.relayA, copyPath), tp.relayB, Options{Pipes: pool}))
			resetMidStream(t, wait, tp.upstream, tp.client, 31, "upstream")
		})
	}
}

// TestRelayIdleHoldsNoPipe: tunnels that have moved bytes and gone quiet
// hold no pipe and no file descriptor beyond their sockets; canceling the
// context then ends them all promptly.
func TestRelayIdleHoldsNoPipe(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 0) // keep no idle pipes, so fds show pipes in use
	const tunnels = 16
	// Sockets exist before the baseline; the tunnels must add nothing.
	tops := make([]topology, tunnels)
	for i := range tops {
		tops[i] = newTopology(t)
	}
	baseFDs := kerneltest.OpenFDs(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	waits := make([]func() (Stats, error), tunnels)
	for i, tp := range tops {
		waits[i] = runRelay(ctx, New(tp.relayA, tp.relayB, Options{Pipes: pool}))
		go echoUpstream(tp.upstream) // until the tunnel is torn down
		msg := make([]byte, 100<<10)
		if _, err := tp.client.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(tp.client, msg); err != nil {
			t.Fatal(err)
		}
	}
	// Every tunnel is now idle: parked in the netpoller waiting to read.
	var st PoolStats
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if st = pool.Stats(); st.InUse == 0 {
			break
		}
	}
	if st.InUse != 0 || st.Idle != 0 || st.Created < tunnels*2 || st.Created != st.Destroyed {
		t.Errorf("idle tunnels' pool: %+v, want every pipe returned", st)
	}
	if fds := kerneltest.OpenFDs(t); fds != baseFDs {
		t.Errorf("%d idle tunnels hold %d file descriptors beyond their sockets", tunnels, fds-baseFDs)
	}

	cancel()
	for i, wait := range waits {
		res, err := wait()
		if !errors.Is(err, context.Canceled) || res.AToB.End != EndCanceled || res.BToA.End != EndCanceled {
			t.Errorf("tunnel %d after cancel: %v, %+v", i, err, res)
		}
		// Canceled mid-stream, the tunnel is cut, not complete: a reset.
		if n, err := tops[i].client.Read(make([]byte, 1)); n != 0 || !errors.Is(sockerr.ReadError(tops[i].client, err), syscall.ECONNRESET) {
			t.Errorf("tunnel %d: client read after cancel: %d, %v; want a reset", i, n, err)
		}
	}
}

// The upstream answers and then resets while the client is still sending:
// the client's direction fails on the dead sink, and the answer, already
// queued on the relay's socket, must still reach the client before the end
// (finish gives the other direction peerGoneGrace to deliver it). Whether
// the answer is read before the failure aborts the tunnel is a race, so the
// test runs 200 times over both paths: one run rarely loses it.
func TestRelayDeliversBeforePeerReset(t *testing.T) {
	for _, copyPath := range []bool{false, true} {
		t.Run(pathName(copyPath), func(t *testing.T) {
			checkLeaks(t)
			pool := newTestPool(t, 4)
			for i := range 200 {
				tp := newTopology(t)
				wait := runRelay(t.Context(), New(maybeOpaque(tp.relayA, copyPath), tp.relayB, Options{Pipes: pool}))
				go io.Copy(tp.client, io.LimitReader(zeros{}, 64<<20)) // until the reset stops it
				if _, err := io.ReadFull(tp.upstream, make([]byte, 1)); err != nil {
					t.Fatal(err)
				}
				tp.upstream.Write([]byte("bye"))
				resetClose(t, tp.upstream)
				tp.client.SetReadDeadline(time.Now().Add(10 * time.Second))
				got, err := io.ReadAll(tp.client)
				// A reset can reach a parked read as "not pollable".
				err = sockerr.ReadError(tp.client, err)
				res, rerr := wait()
				for _, c := range []*net.TCPConn{tp.client, tp.relayA, tp.relayB} {
					c.Close()
				}
				if string(got) != "bye" || (err != nil && !isResetOrPipe(err)) {
					t.Fatalf("run %d: client read %q, %v; want \"bye\" then the end (relay: %v, %+v)", i, got, err, rerr, res)
				}
				checkResetResult(t, res, rerr)
			}
		})
	}
}

// A tunnel that fails tells both peers: canceled mid-stream, each reads a
// reset after every byte relayed before it, not an orderly end. A side
// whose direction had already ended in order keeps that end: after the
// client's half-close has reached the upstream, the cancel resets only the
// client. On the copy path the reset reaches the socket through NetConn (as
// under a *tls.Conn); a connection with Abort is aborted instead, and only
// when its direction did not end in order.
func TestRelayFailureResetsPeers(t *testing.T) {
	for _, copyPath := range []bool{false, true} {
		t.Run(pathName(copyPath), func(t *testing.T) {
			checkLeaks(t)
			pool := newTestPool(t, 2)
			for _, halfClosed := range []bool{false, true} {
				tp := newTopology(t)
				ctx, cancel := context.WithCancel(t.Context())
				wait := runRelay(ctx, New(maybeOpaque(tp.relayA, copyPath), tp.relayB, Options{Pipes: pool}))
				sent := goSend(tp.client, 1*MiB, 40)
				got := readExact(t, tp.upstream, 1*MiB)
				if halfClosed {
					tp.client.CloseWrite()
				}
				if !bytes.Equal(got, sent(t)) {
					t.Fatal("upstream got other bytes than the client sent")
				}
				if halfClosed {
					if n, err := tp.upstream.Read(make([]byte, 1)); n != 0 || err != io.EOF {
						t.Fatalf("upstream read after the client's half-close: %d, %v; want EOF", n, err)
					}
				}
				answer := goSend(tp.upstream, 1*MiB, 41)
				if got := readExact(t, tp.client, 1*MiB); !bytes.Equal(got, answer(t)) {
					t.Fatal("client got other bytes than the upstream sent")
				}
				cancel()
				res, err := wait()
				if !errors.Is(err, context.Canceled) {
					t.Fatalf("relay: %v, %+v; want canceled", err, res)
				}
				if n, err := tp.client.Read(make([]byte, 1)); n != 0 || !errors.Is(sockerr.ReadError(tp.client, err), syscall.ECONNRESET) {
					t.Errorf("half-closed %v: client read after cancel: %d, %v; want a reset", halfClosed, n, err)
				}
				n, err := tp.upstream.Read(make([]byte, 1))
				err = sockerr.ReadError(tp.upstream, err)
				if halfClosed && (n != 0 || err != io.EOF) {
					t.Errorf("upstream read after its orderly end and the cancel: %d, %v; want EOF still", n, err)
				}
				if !halfClosed && (n != 0 || !errors.Is(err, syscall.ECONNRESET)) {
					t.Errorf("upstream read after cancel: %d, %v; want a reset", n, err)
				}
			}
		})
	}
}

// abortRecorder is a copy-path connection with Abort, as *ktls.Conn has.
type abortRecorder struct {
	opaqueConn
	aborted atomic.Bool
}

func (c *abortRecorder) Abort() error {
	c.aborted.Store(true)
	return c.Close()
}

// A failed tunnel calls Abort on a side that has it (and did not get its
// orderly end); a tunnel that ended in order never does.
func TestRelayAbortsAborter(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	for _, fail := range []bool{false, true} {
		tp := newTopology(t)
		a := &abortRecorder{opaqueConn: opaqueConn{tp.relayA}}
		ctx, cancel := context.WithCancel(t.Context())
		wait := runRelay(ctx, New(a, tp.relayB, Options{Pipes: pool}))
		sent := goSend(tp.client, 64<<10, 42)
		if got := readExact(t, tp.upstream, 64<<10); !bytes.Equal(got, sent(t)) {
			t.Fatal("upstream got other bytes than the client sent")
		}
		if fail {
			cancel()
		} else {
			tp.client.CloseWrite()
			tp.upstream.CloseWrite()
		}
		res, err := wait()
		cancel()
		if (err != nil) != fail || a.aborted.Load() != fail {
			t.Errorf("failed %v: relay %v (%+v), Abort called %v", fail, err, res, a.aborted.Load())
		}
		tp.client.Close()
		tp.upstream.Close()
	}
}

// zeros reads as an endless stream of zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// Both peers half-close at once, many times over: each direction's end must
// read as an orderly EOF, never as a reset. The direction that ends second
// sees its source in TCP_CLOSE when the first one's FIN has already been
// acknowledged, which a reset looks like too, so finish must read the
// socket's state before the other direction's sinkClosing. Getting that
// order wrong is a race that one round rarely hits, hence the 500 rounds.
func TestBothEndsCloseTogether(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 2)
	for i := range 500 {
		tp := newTopology(t)
		tp.client.CloseWrite()
		tp.upstream.CloseWrite()
		res, err := New(tp.relayA, tp.relayB, Options{Pipes: pool}).Run(t.Context())
		for _, c := range []*net.TCPConn{tp.client, tp.relayA, tp.relayB, tp.upstream} {
			c.Close()
		}
		if err != nil || res.AToB.End != EndEOF || res.BToA.End != EndEOF {
			t.Fatalf("run %d: %v, ends %v / %v; want two orderly ends", i, err, res.AToB.End, res.BToA.End)
		}
	}
}

func TestRunTwice(t *testing.T) {
	checkLeaks(t)
	tp := newTopology(t)
	tun := New(tp.relayA, tp.relayB, Options{Pipes: newTestPool(t, 1)})
	tp.client.CloseWrite()
	tp.upstream.CloseWrite()
	if _, err := tun.Run(t.Context()); err != nil {
		t.Fatal(err)
	}
	if _, err := tun.Run(t.Context()); err == nil {
		t.Fatal("second Run succeeded")
	}
}

// streamHalfClosed sends size pattern bytes (seed) from src and then
// half-closes it, while dst (named dstName in failures) reads to EOF; it
// fails t unless dst got exactly the bytes sent.
func streamHalfClosed(t *testing.T, src, dst *net.TCPConn, seed uint64, size int64, dstName string) {
	t.Helper()
	sendDone := make(chan error, 1)
	var sent []byte
	go func() {
		var err error
		sent, err = sendStream(src, seed, size)
		if err == nil {
			err = src.CloseWrite()
		}
		sendDone <- err
	}()
	n, sum, err := recvStream(dst)
	if serr := <-sendDone; serr != nil {
		t.Fatal(serr)
	}
	if err != nil || n != size || string(sum) != string(sent) {
		t.Fatalf("%s got %d bytes (err %v), digest match %v; want %d", dstName, n, err, string(sum) == string(sent), size)
	}
}

// waitEnd waits up to 5 s for direction d to end and returns the stats.
func waitEnd(tun *Relay, d Direction) Stats {
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if st := tun.Stats(); st.Dir(d).End != EndRunning {
			return st
		}
	}
	return tun.Stats()
}

func maybeOpaque(c *net.TCPConn, opaque bool) net.Conn {
	if opaque {
		return opaqueConn{c}
	}
	return c
}

func pathName(copyPath bool) string {
	if copyPath {
		return "copy"
	}
	return "splice"
}

func TestRunNilConn(t *testing.T) {
	tp := newTopology(t)
	if _, err := New(tp.relayA, nil, Options{}).Run(t.Context()); err == nil {
		t.Fatal("Run with a nil connection succeeded")
	}
}

package splice

import (
	"crypto/tls"
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/splicetest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// handoffConn moves a kTLS connection as the upgrade does: Handoff, the
// state through its encoding, Adopt on the socket Handoff returned, and
// the old Conn closed (which releases only its own descriptors).
func handoffConn(t *testing.T, c net.Conn) net.Conn {
	t.Helper()
	kc := c.(*ktls.Conn)
	st, sock, err := kc.Handoff()
	if err != nil {
		t.Fatalf("handoff: %v", err)
	}
	enc, err := st.Encode()
	st.Zero()
	if err != nil {
		t.Fatal(err)
	}
	st, err = ktls.DecodeHandoffState(enc)
	clear(enc)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := ktls.Adopt(sock, st, ktls.Options{})
	st.Zero()
	if err != nil {
		t.Fatalf("adopt: %v", err)
	}
	kc.Close()
	t.Cleanup(func() { nc.Close() })
	return nc
}

// TestKernelPauseHandoff: a pattern each way between a Go TLS client and
// an echo-less upstream through a kTLS server conn, both directions
// spliced (kTLS RX into TCP, TCP into kTLS TX). The relay is paused six
// times mid-stream; each time the kTLS conn is handed off and adopted and
// the TCP side moved to a duplicated socket, and a new Relay resumes; every
// third time one side's reader stops first, so that a pipe may be handed
// over with bytes bound for kTLS TX or from kTLS RX. Both streams arrive
// exact, the counters add up across the relays, the kernel installed each
// direction's key once (no reinstall on adoption) and decrypted every
// record.
func TestKernelPauseHandoff(t *testing.T) {
	kerneltest.Require(t)
	size := int64(kerneltest.BulkMiB(t, 8)) * MiB // KTLS_TEST_MIB
	ktls.Probe()
	for _, tc := range []struct {
		name    string
		version uint16
	}{{"tls13", tls.VersionTLS13}, {"tls12", tls.VersionTLS12}} {
		t.Run(tc.name, func(t *testing.T) {
			checkLeaks(t)
			pool := newTestPool(t, 4)
			var res Stats
			var err error
			var pending [2]int
			delta := kerneltest.StatDelta(t, func() {
				tp := newKTLSTopology(t, tc.version, ktls.Options{RequireOffload: true})
				bounded(t, tp.gateway, tp.upstream)
				smallSinks(t, topology{relayA: tp.server.NetConn().(*net.TCPConn), relayB: tp.relayB, client: tp.gateway.NetConn().(*net.TCPConn), upstream: tp.upstream})
				var gates [2]sync.RWMutex
				sentAB := goSend(tp.gateway, size, 41)
				sentBA := goSend(tp.upstream, size, 42)
				gotAB := goPacedRead(tp.upstream, size, time.Millisecond, &gates[AToB])
				gotBA := goPacedRead(tp.gateway, size, time.Millisecond, &gates[BToA])
				pz := startPausing(t, tp.server, tp.relayB, Options{Pipes: pool})
				pz.move = func(a, b net.Conn) (net.Conn, net.Conn) { return handoffConn(t, a), moveConn(t, b) }
				var last PauseState
				for i := range 6 {
					time.Sleep(20 * time.Millisecond)
					d := Direction(i / 3 % 2)
					blocked := i%3 == 2
					if blocked {
						gates[d].Lock()
						pz.stalled(d)
					}
					last = pz.cycle()
					if blocked {
						t.Logf("pause %d, %s's reader stopped: %+v", i, d, last.Dirs[d])
						gates[d].Unlock()
					}
				}
				pending = pz.pending
				for d, pd := range last.Dirs {
					if pd.Bytes+pd.Pending >= size {
						t.Fatalf("%s had moved everything (%d bytes, %d pending) by the last pause: the pauses must land mid-stream", Direction(d), pd.Bytes, pd.Pending)
					}
				}
				if string(gotAB(t)) != string(sentAB(t)) || string(gotBA(t)) != string(sentBA(t)) {
					t.Fatal("a stream arrived corrupted through the pauses and handoffs")
				}
				tp.gateway.CloseWrite() // close_notify, through the adopted conn
				tp.upstream.CloseWrite()
				res, err = pz.wait()
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("result %+v; pauses with a pipe handed over %v; tls_stat delta %v", res, pending, delta)
			if pending[AToB] == 0 || pending[BToA] == 0 {
				t.Errorf("pauses with a pipe handed over: %v, want some in each direction (plaintext from kTLS RX, and bound for kTLS TX)", pending)
			}
			in, out := res.AToB, res.BToA
			if in.Bytes != size || in.SpliceBytes != size || in.ControlRecords != 1 || in.End != EndEOF {
				t.Errorf("gateway->upstream %+v, want %d bytes spliced from kTLS RX, close_notify the one control record", in, size)
			}
			if out.Bytes != size || out.SpliceBytes != size || out.End != EndEOF {
				t.Errorf("upstream->gateway %+v, want %d bytes spliced into kTLS TX", out, size)
			}
			if delta["TlsTxSw"] != 1 || delta["TlsRxSw"] != 1 {
				t.Errorf("TlsTxSw %+d, TlsRxSw %+d: want each key installed once, across the handoffs", delta["TlsTxSw"], delta["TlsRxSw"])
			}
			if delta["TlsCurrTxSw"] != 0 || delta["TlsCurrRxSw"] != 0 {
				t.Errorf("kTLS sockets left open: TlsCurrTxSw %+d, TlsCurrRxSw %+d", delta["TlsCurrTxSw"], delta["TlsCurrRxSw"])
			}
			if delta["TlsDecryptError"] != 0 {
				t.Errorf("TlsDecryptError moved by %d", delta["TlsDecryptError"])
			}
		})
	}
}

// closeWaitingConn is a kTLS conn whose first CloseWrite waits until a
// Pause's deadline is on the socket and then half-closes for real, so that
// the kernel TX path's close_notify meets that deadline.
type closeWaitingConn struct {
	*ktls.Conn
	entered  chan struct{}
	firstErr error // the first, real CloseWrite's
	calls    atomic.Int32
}

func (c *closeWaitingConn) CloseWrite() error {
	if c.calls.Add(1) == 1 {
		close(c.entered)
		rc, ok := c.Conn.SpliceSink()
		if !ok {
			c.firstErr = errors.New("TX is not in the kernel")
			return c.firstErr
		}
		if !splicetest.AwaitPastDeadline(rc, 10*time.Second) {
			c.firstErr = errors.New("no deadline came")
			return c.firstErr
		}
		c.firstErr = c.Conn.CloseWrite()
		return c.firstErr
	}
	return c.Conn.CloseWrite()
}

// TestKernelPauseDuringHalfClose: the upstream ends its stream, and the
// relay's half-close of the kTLS conn (its close_notify, through kernel TX)
// meets a Pause's deadline. The close_notify is sent once, after the
// refusal of that try; the Pause then commits with that direction ended,
// the kTLS conn is handed off and adopted, and the resumed relay carries
// the gateway's stream to its close_notify. Both streams arrive exact, the
// gateway reads the upstream's end as a close_notify, and the kernel
// decrypted every record.
func TestKernelPauseDuringHalfClose(t *testing.T) {
	kerneltest.Require(t)
	ktls.Probe()
	checkLeaks(t)
	const size = 256 << 10
	var res Stats
	var err error
	var conn *closeWaitingConn
	delta := kerneltest.StatDelta(t, func() {
		tp := newKTLSTopology(t, tls.VersionTLS13, ktls.Options{RequireOffload: true})
		bounded(t, tp.gateway, tp.upstream)
		conn = &closeWaitingConn{Conn: tp.server, entered: make(chan struct{})}
		opts := Options{Pipes: newTestPool(t, 2)}
		tun := New(conn, tp.relayB, opts)
		wait := runStarted(t, tun)
		sentBA := goSend(tp.upstream, size, 52)
		type received struct {
			n   int64
			sum []byte
		}
		gotBA := make(chan received, 1)
		go func() {
			// crypto/tls ends a Read with io.EOF only at a close_notify.
			n, sum, err := recvStream(tp.gateway)
			if err != nil {
				t.Errorf("gateway's read of the upstream's stream: %v, want its end as close_notify", err)
			}
			gotBA <- received{n, sum}
		}()
		sentAB := goSend(tp.gateway, size, 51)
		if got := readExact(t, tp.upstream, size); string(got) != string(sentAB(t)) {
			t.Fatal("gateway->upstream corrupted before the pause")
		}
		sentBA(t)
		tp.upstream.CloseWrite()
		<-conn.entered
		p, perr := tun.Pause(t.Context())
		if perr != nil {
			t.Fatalf("Pause during the half-close: %v", perr)
		}
		defer p.Close()
		if _, err := wait(); !errors.Is(err, ErrPaused) {
			t.Fatalf("Run after Pause: %v, want ErrPaused", err)
		}
		if ba := p.State.Dirs[BToA]; ba.End != EndEOF || ba.Bytes != size {
			t.Fatalf("upstream->gateway in the paused state %+v, want ended (eof) after %d bytes", ba, size)
		}
		a := handoffConn(t, tp.server)
		next, rerr := Resume(a, tp.relayB, p, opts)
		if rerr != nil {
			t.Fatal(rerr)
		}
		wait = runStarted(t, next)
		if got := <-gotBA; got.n != size || string(got.sum) != string(sentBA(t)) {
			t.Fatalf("upstream->gateway: %d bytes arrived, not the %d sent", got.n, size)
		}
		more := goSend(tp.gateway, size, 53)
		if got := readExact(t, tp.upstream, size); string(got) != string(more(t)) {
			t.Fatal("gateway->upstream corrupted after the resume")
		}
		tp.gateway.CloseWrite()
		res, err = wait()
	})
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(conn.firstErr, os.ErrDeadlineExceeded) {
		t.Errorf("the first CloseWrite: %v, want the Pause's deadline", conn.firstErr)
	}
	if n := conn.calls.Load(); n != 2 {
		t.Errorf("CloseWrite called %d times, want 2", n)
	}
	if res.AToB.Bytes != 2*size || res.AToB.End != EndEOF || res.BToA.Bytes != size || res.BToA.End != EndEOF {
		t.Errorf("result %+v, want %d bytes gateway->upstream and %d back, both eof", res, 2*size, size)
	}
	if delta["TlsDecryptError"] != 0 {
		t.Errorf("TlsDecryptError moved by %d", delta["TlsDecryptError"])
	}
	if delta["TlsCurrTxSw"] != 0 || delta["TlsCurrRxSw"] != 0 {
		t.Errorf("kTLS sockets left open: TlsCurrTxSw %+d, TlsCurrRxSw %+d", delta["TlsCurrTxSw"], delta["TlsCurrRxSw"])
	}
}

package splice

import (
	"crypto/tls"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// handoffConn moves a kTLS connection as the upgrade does: Handoff, the
// state through its encoding, Adopt on the duplicated socket, and the old
// Conn closed (which releases only its own descriptors).
func handoffConn(t *testing.T, c net.Conn) net.Conn {
	t.Helper()
	kc := c.(*ktls.Conn)
	st, f, err := kc.Handoff()
	if err != nil {
		t.Fatalf("handoff: %v", err)
	}
	defer f.Close()
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
	nc, err := ktls.Adopt(f, st, ktls.Options{})
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

package splice

import (
	"errors"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/splicetest"
)

// TestPauseStress: tunnels whose two streams end at random times (each
// side sends a random amount, then half-closes) are paused and resumed
// over and over at random moments, until they end. Every stream arrives
// exact and ends in order, and the last relay's counters are the
// streams' sizes: no pause, wherever it lands (mid-burst, on a source's
// end, on a half-close, after one direction ended), loses a byte or ends
// a tunnel.
func TestPauseStress(t *testing.T) {
	checkLeaks(t)
	pool := newTestPool(t, 8)
	const tunnels = 12
	var wg sync.WaitGroup
	for i := range tunnels {
		tp := newTopology(t)
		bounded(t, tp.client, tp.upstream)
		rng := rand.New(rand.NewPCG(uint64(i), 7))
		sizes := [2]int64{rng.Int64N(8 * MiB), rng.Int64N(8 * MiB)}
		wg.Go(func() {
			sent := [2]func(*testing.T) []byte{goSend(tp.client, sizes[AToB], uint64(100+2*i)), goSend(tp.upstream, sizes[BToA], uint64(101+2*i))}
			type got struct {
				n   int64
				sum []byte
				err error
			}
			var recv [2]chan got
			for d, r := range []net.Conn{tp.upstream, tp.client} {
				recv[d] = make(chan got, 1)
				go func() {
					n, sum, err := recvStream(r)
					recv[d] <- got{n, sum, err}
				}()
			}
			go func() {
				sent[AToB](t)
				time.Sleep(time.Duration(rng.IntN(5)) * time.Millisecond)
				tp.client.CloseWrite()
			}()
			go func() {
				sent[BToA](t)
				tp.upstream.CloseWrite()
			}()
			a, b := splicetest.RecordCloser{TCPConn: tp.relayA}, splicetest.RecordCloser{TCPConn: tp.relayB}
			opts := Options{Pipes: pool}
			tun := New(a, b, opts)
			wait := runStarted(t, tun)
			pauses := 0
			for {
				time.Sleep(time.Duration(rand.IntN(1500)) * time.Microsecond)
				p, err := tun.Pause(t.Context())
				var pe *PauseError
				if errors.As(err, &pe) && pe.Reason == PauseEnded {
					break
				}
				if err != nil {
					t.Errorf("tunnel %d: pause %d: %v", i, pauses, err)
					break
				}
				pauses++
				if _, err := wait(); !errors.Is(err, ErrPaused) {
					t.Errorf("tunnel %d: Run after pause %d: %v", i, pauses, err)
				}
				next, err := Resume(a, b, p, opts)
				p.Close()
				if err != nil {
					t.Errorf("tunnel %d: resume %d: %v", i, pauses, err)
					return
				}
				tun, wait = next, runStarted(t, next)
			}
			res, err := wait()
			if err != nil {
				t.Errorf("tunnel %d after %d pauses: %v (%+v)", i, pauses, err, res)
			}
			for d := range sizes {
				g := <-recv[d]
				if g.err != nil || g.n != sizes[d] || string(g.sum) != string(sent[d](t)) {
					t.Errorf("tunnel %d, %s: %d of %d bytes, %v", i, Direction(d), g.n, sizes[d], g.err)
				}
				if ds := res.Dir(Direction(d)); ds.Bytes != sizes[d] || ds.End != EndEOF {
					t.Errorf("tunnel %d, %s: %+v, want %d bytes, eof", i, Direction(d), ds, sizes[d])
				}
			}
			t.Logf("tunnel %d: %d pauses, %v bytes", i, pauses, sizes)
		})
	}
	wg.Wait()
}

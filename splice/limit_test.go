package splice

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// The bucket grants up to its tokens, makes a direction wait for a whole
// step once empty, refills at its rate up to its burst, and takes refunds.
func TestRateLimiterBucket(t *testing.T) {
	now := time.Unix(1000, 0)
	l := NewRateLimiter(1<<20, 64<<10) // 1 MiB/s, 64 KiB burst
	l.now = func() time.Time { return now }
	if n, w := l.Grant(1 << 20); n != 64<<10 || w != 0 {
		t.Fatalf("a full bucket granted %d (wait %v), want the 64 KiB burst", n, w)
	}
	n, w := l.Grant(1 << 20)
	if n != 0 || w != 15625*time.Microsecond { // 16 KiB at 1 MiB/s
		t.Fatalf("an empty bucket: %d, wait %v; want 0 and the time for 16 KiB", n, w)
	}
	now = now.Add(w)
	if n, _ := l.Grant(1 << 20); n != minGrant {
		t.Errorf("after the wait: %d, want %d", n, minGrant)
	}
	now = now.Add(time.Hour)
	if n, _ := l.Grant(1 << 30); n != 64<<10 {
		t.Errorf("after an hour: %d, want the burst only", n)
	}
	l.Refund(1000)
	if n, _ := l.Grant(500); n != 500 {
		t.Errorf("after a refund of 1000, 500 wanted: %d", n)
	}
	if n, w := l.Grant(1 << 20); n != 0 || w == 0 {
		t.Errorf("500 tokens left, a large want: %d (wait %v), want a wait for a whole step", n, w)
	}
	if n, _ := l.Grant(500); n != 500 {
		t.Errorf("500 tokens left, 500 wanted: %d", n)
	}
}

// A bucket handed to another process: TakeTokens returns what it holds,
// refilled to now, and leaves it empty; a bucket made holding them grants
// exactly those; PutTokens gives them back.
func TestRateLimiterTakeTokens(t *testing.T) {
	now := time.Unix(1000, 0)
	l := NewRateLimiter(1<<20, 64<<10)
	l.now = func() time.Time { return now }
	if n, _ := l.Grant(40 << 10); n != 40<<10 {
		t.Fatalf("granted %d", n)
	}
	now = now.Add(time.Second / 128) // 8 KiB at 1 MiB/s
	if got := l.TakeTokens(); got != 32<<10 {
		t.Fatalf("TakeTokens: %d, want the 24 KiB left and 8 KiB refilled", got)
	}
	if n, w := l.Grant(1 << 20); n != 0 || w == 0 {
		t.Errorf("after TakeTokens: granted %d (wait %v), want an empty bucket", n, w)
	}
	l.PutTokens(32 << 10)
	if n, _ := l.Grant(1 << 20); n != 32<<10 {
		t.Errorf("after PutTokens: granted %d, want 32 KiB", n)
	}
	moved := NewRateLimiterHolding(1<<20, 64<<10, 20<<10)
	moved.now, moved.last = func() time.Time { return now }, now
	if n, _ := moved.Grant(1 << 20); n != 20<<10 {
		t.Errorf("a bucket made holding 20 KiB granted %d", n)
	}
	if full := NewRateLimiterHolding(1<<20, 64<<10, 1<<30); full.tokens != 64<<10 {
		t.Errorf("a bucket made holding more than its burst holds %v", full.tokens)
	}
}

// A capped direction moves its bytes exact at the cap (never faster than
// rate × time + burst), the other direction unhindered; two tunnels that
// share one Limiter share its rate; the wait is reported as Throttled.
func TestRelayRateLimit(t *testing.T) {
	const rate, burst, size = 4 << 20, 64 << 10, 2 << 20
	for _, copyPath := range []bool{false, true} {
		name := map[bool]string{false: "splice", true: "copy"}[copyPath]
		t.Run(name, func(t *testing.T) {
			lim := NewRateLimiter(rate, burst)
			var wg sync.WaitGroup
			start := time.Now()
			stats := make([]Stats, 2)
			for i := range 2 {
				wg.Go(func() {
					tp := newTopology(t)
					a := netConnOf(tp.relayA, copyPath)
					wait := runRelay(context.Background(), New(a, tp.relayB, Options{Pipes: newTestPool(t, 4), Limit: [2]Limiter{AToB: lim}}))
					sent := goSend(tp.client, size, uint64(i+1))
					got := readExact(t, tp.upstream, size)
					if string(got) != string(sent(t)) {
						t.Errorf("tunnel %d: the bytes differ", i)
					}
					tp.client.CloseWrite()
					tp.upstream.CloseWrite()
					io.Copy(io.Discard, tp.client)
					st, err := wait()
					if err != nil {
						t.Errorf("tunnel %d: %v", i, err)
					}
					stats[i] = st
				})
			}
			wg.Wait()
			elapsed := time.Since(start)
			// Two tunnels share one bucket: 2 × size at the rate, less the burst.
			floor := time.Duration(float64(2*size-burst) / rate * float64(time.Second))
			if elapsed < floor {
				t.Errorf("%d bytes in %v under a %d B/s cap: faster than %v", 2*size, elapsed, rate, floor)
			}
			for i, st := range stats {
				if st.AToB.Bytes != size || st.AToB.Throttled == 0 || st.AToB.Spliced == copyPath {
					t.Errorf("tunnel %d: %+v, want %d bytes, throttled, spliced %v", i, st.AToB, size, !copyPath)
				}
			}
		})
	}
}

// A tunnel canceled while its direction waits for the Limiter ends at
// once.
func TestRelayRateLimitAbort(t *testing.T) {
	tp := newTopology(t)
	lim := NewRateLimiter(1, minGrant) // one byte a second after the first 16 KiB
	ctx, cancel := context.WithCancel(context.Background())
	wait := runRelay(ctx, New(tp.relayA, tp.relayB, Options{Pipes: newTestPool(t, 4), Limit: [2]Limiter{AToB: lim}}))
	goSend(tp.client, 64<<10, 3)
	readExact(t, tp.upstream, minGrant)
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	cancel()
	st, err := wait()
	if err == nil || time.Since(start) > 5*time.Second {
		t.Errorf("canceled throttled relay: %v after %v", err, time.Since(start))
	}
	if st.AToB.Throttled == 0 || st.AToB.Bytes != minGrant {
		t.Errorf("%+v: want %d bytes and a throttled wait", st.AToB, minGrant)
	}
}

// netConnOf is c, hidden from splice (the copy path) when copyPath.
func netConnOf(c *net.TCPConn, copyPath bool) net.Conn {
	if copyPath {
		return opaqueConn{c}
	}
	return c
}

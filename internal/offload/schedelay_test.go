package offload

import (
	"math"
	"runtime"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/cputest"
)

// windowP90 takes the 90th percentile of what the counts gained since
// base, rounded down to its bucket's lower bound; the first bucket's lower
// bound (-Inf) is 0.
func TestWindowP90(t *testing.T) {
	bounds := []float64{math.Inf(-1), 0, 0.001, 0.002, 0.004, math.Inf(1)}
	for _, tc := range []struct {
		name         string
		base, counts []uint64
		want         time.Duration
		n            uint64
	}{
		{"nothing new", []uint64{1, 2, 3, 4, 5}, []uint64{1, 2, 3, 4, 5}, 0, 0},
		{"all in one bucket", []uint64{0, 0, 0, 0, 0}, []uint64{0, 0, 7, 0, 0}, time.Millisecond, 7},
		{"the base is taken off", []uint64{0, 9, 0, 0, 0}, []uint64{0, 10, 1, 3, 0}, 2 * time.Millisecond, 5},
		{"most wait nothing: the tenth that waits", []uint64{0, 0, 0, 0, 0}, []uint64{0, 8, 0, 2, 0}, 2 * time.Millisecond, 10},
		{"exactly nine tenths below", []uint64{0, 0, 0, 0, 0}, []uint64{0, 9, 0, 1, 0}, 0, 10},
		{"the unbounded bucket", []uint64{0, 0, 0, 0, 0}, []uint64{0, 0, 0, 1, 3}, 4 * time.Millisecond, 4},
		{"the first bucket", []uint64{0, 0, 0, 0, 0}, []uint64{10, 0, 0, 0, 1}, 0, 11},
	} {
		got, n := windowP90(tc.base, tc.counts, bounds)
		if got != tc.want || n != tc.n {
			t.Errorf("%s: 90th percentile %v of %d samples, want %v of %d", tc.name, got, n, tc.want, tc.n)
		}
	}
}

// A window ends once it is SchedulingDelayWindow old and holds
// SchedulingDelayMinSamples; one with fewer samples goes on, up to
// schedulingDelayMaxWindow, where it says nothing (0). Between the ends of
// windows the histogram is not read.
func TestSchedDelayWindows(t *testing.T) {
	bounds := []float64{math.Inf(-1), 0, 0.001, 0.010, 0.100, math.Inf(1)}
	counts := make([]uint64, 5)
	reads := 0
	d := newSchedDelay(func(dst []uint64) ([]uint64, []float64) {
		reads++
		return append(dst[:0], counts...), bounds
	})
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	step := func(ms int, want time.Duration, wantReads int) {
		t.Helper()
		if got := d.At(at(ms)); got != want || reads != wantReads {
			t.Errorf("at %d ms: delay %v after %d reads, want %v after %d", ms, got, reads, want, wantReads)
		}
	}
	step(0, 0, 1) // the first window starts
	counts[3] += SchedulingDelayMinSamples
	step(50, 0, 1)                    // too young: not read
	step(100, 10*time.Millisecond, 2) // ends: all 16 in [10 ms, 100 ms)
	counts[2] += SchedulingDelayMinSamples - 1
	step(150, 10*time.Millisecond, 2) // the last window's, not read
	step(200, 10*time.Millisecond, 3) // 15 samples: the window goes on
	counts[2]++
	step(300, time.Millisecond, 4) // 16 since 100 ms
	counts[4] += 3
	step(400, time.Millisecond, 5)
	step(1299, time.Millisecond, 6)
	step(1300, time.Millisecond, 6) // read at 1299: the next read is due at 1399
	step(1399, 0, 7)                // over a second with 3 samples: nothing to say
	counts[3] += 20
	step(1500, 10*time.Millisecond, 8)
}

// The process's scheduling delay, read from the runtime: with more
// runnable goroutines than Ps, each waits its turn, so the delay is well
// above a millisecond; once they stop, an idle process's windows say
// nothing again.
func TestSchedulingDelayMeasuresRunQueue(t *testing.T) {
	stop := cputest.Busy(8 * runtime.GOMAXPROCS(0))
	defer stop()
	d := newSchedDelay(readSchedLatencies)
	wait := func(cond func(time.Duration) bool, what string) time.Duration {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			m := d.At(time.Now())
			if cond(m) {
				return m
			}
			if time.Now().After(deadline) {
				t.Fatalf("the scheduling delay stayed %v, want %s", m, what)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	m := wait(func(m time.Duration) bool { return m > 2*time.Millisecond }, "above 2 ms with 8 busy goroutines a P")
	t.Logf("%d busy goroutines a P: scheduling delay %v", 8, m)
	stop()
	wait(func(m time.Duration) bool { return m < time.Millisecond }, "below 1 ms once they stopped")
}

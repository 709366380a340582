package offload

import (
	"math"
	"runtime/metrics"
	"sync"
	"sync/atomic"
	"time"
)

// The scheduling delay is how long this process's goroutines wait,
// runnable, for a CPU: the Go scheduler's run-queue delay, which the
// runtime records in /sched/latencies:seconds. A process with more work
// than CPUs makes every goroutine wait, a connection's at each step of its
// handshake, so the delay says what an admitted connection will wait for,
// whatever the round trips to its peer: a handshake waiting on its peer is
// not runnable. Time the kernel gives to other processes is not in it:
// from the runtime's view, a goroutine on a descheduled thread runs.
//
// The statistic is the 90th percentile over a window, not the median: a
// goroutine woken by another (a channel, a lock) runs next on its P with
// no wait, and such wakeups can be most samples, the median 0, while
// every goroutine woken by the network waits its turn behind a queue.
//
// The runtime samples the delay (about one transition in eight), so a
// window holds at least SchedulingDelayMinSamples samples: it spans
// SchedulingDelayWindow or more, and up to schedulingDelayMaxWindow, past
// which a window with fewer samples (an idle process) says nothing.
const (
	// SchedulingDelayWindow is the shortest window the percentile is
	// taken over.
	SchedulingDelayWindow = 100 * time.Millisecond
	// SchedulingDelayMinSamples are the samples a window needs.
	SchedulingDelayMinSamples = 16
	// schedulingDelayMaxWindow is the longest window.
	schedulingDelayMaxWindow = time.Second
)

const schedLatencies = "/sched/latencies:seconds"

// SchedulingDelay is the process's scheduling delay signal.
var SchedulingDelay = newSchedDelay(readSchedLatencies)

// schedDelay keeps the scheduling delay (the 90th percentile) of the last
// complete window. It reads the runtime's histogram when a caller asks for the
// delay and the window is SchedulingDelayWindow old, so it costs nothing
// while nobody asks and needs no goroutine.
type schedDelay struct {
	read func(dst []uint64) ([]uint64, []float64) // cumulative counts, bucket bounds

	delay atomic.Int64 // ns, the last complete window's; 0: none
	next  atomic.Int64 // unix ns at which the window may end

	mu     sync.Mutex // guards the window: one reader at a time
	start  time.Time  // the window's start
	base   []uint64   // the counts at start
	counts []uint64   // scratch
}

func newSchedDelay(read func(dst []uint64) ([]uint64, []float64)) *schedDelay {
	return &schedDelay{read: read}
}

// readSchedLatencies reads the runtime's cumulative histogram of
// scheduling delays into dst.
func readSchedLatencies(dst []uint64) ([]uint64, []float64) {
	s := []metrics.Sample{{Name: schedLatencies}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindFloat64Histogram {
		return dst[:0], nil
	}
	h := s[0].Value.Float64Histogram()
	return append(dst[:0], h.Counts...), h.Buckets
}

// At returns the scheduling delay (the 90th percentile) of the last
// complete window that ended at most SchedulingDelayWindow before now, or 0
// where none (an idle process, or a runtime without the metric).
func (d *schedDelay) At(now time.Time) time.Duration {
	if now.UnixNano() >= d.next.Load() && d.mu.TryLock() {
		d.update(now)
		d.mu.Unlock()
	}
	return time.Duration(d.delay.Load())
}

// update ends the window if it is old enough and holds enough samples;
// the caller holds mu.
func (d *schedDelay) update(now time.Time) {
	age := now.Sub(d.start)
	if age < SchedulingDelayWindow && d.base != nil {
		return
	}
	var bounds []float64
	d.counts, bounds = d.read(d.counts)
	d.next.Store(now.Add(SchedulingDelayWindow).UnixNano())
	if d.base == nil || len(d.base) != len(d.counts) {
		d.start, d.base = now, append(d.base[:0], d.counts...)
		return
	}
	p, n := windowP90(d.base, d.counts, bounds)
	switch {
	case n >= SchedulingDelayMinSamples:
		d.delay.Store(int64(p))
	case age >= schedulingDelayMaxWindow:
		d.delay.Store(0)
	default:
		return // the window goes on
	}
	d.start, d.base = now, append(d.base[:0], d.counts...)
}

// windowP90 returns the 90th percentile of the samples counts holds more
// than base (cumulative histograms over bounds, len(bounds) == len(counts)+1),
// rounded down to the lower bound of the bucket it falls in (the
// runtime's buckets are a quarter of a power of two or finer), and how
// many samples there were.
func windowP90(base, counts []uint64, bounds []float64) (time.Duration, uint64) {
	var n uint64
	for i := range counts {
		n += counts[i] - base[i]
	}
	if n == 0 {
		return 0, 0
	}
	var seen uint64
	for i := range counts {
		seen += counts[i] - base[i]
		if 10*seen >= 9*n {
			s := bounds[i]
			if math.IsInf(s, -1) {
				s = 0
			}
			return time.Duration(s * float64(time.Second)), n
		}
	}
	return 0, n
}

package forward

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/ktlsingress/caddy-ktls/splice"
)

// Bandwidth caps one sandbox's tunnels in one direction: every tunnel of
// the sandbox in the process shares one token bucket
// (splice.RateLimiter), so opening more tunnels does not raise the cap.
type Bandwidth struct {
	// BytesPerSecond is the sustained rate; zero means no cap.
	BytesPerSecond int64
	// Burst is how many bytes may move at once after a quiet spell. Zero
	// means a tenth of a second's worth, at least 64 KiB.
	Burst int64
}

func (b Bandwidth) burst() int64 {
	if b.Burst > 0 {
		return b.Burst
	}
	return max(b.BytesPerSecond/10, 64<<10)
}

// limiterTable holds the buckets of the sandboxes that have a capped
// tunnel open, and the time capped directions waited. It is part of the
// Registry (process-level: caps hold across reloads); its zero value is
// ready.
type limiterTable struct {
	mu      sync.Mutex
	buckets map[limiterKey]*limiterEntry
	// seeds are the token levels of buckets another process handed over
	// (Registry.AdoptReports): the bucket's first acquire starts from it.
	seeds map[limiterKey]int64
	// Time capped directions spent waiting, by direction, over closed
	// tunnels.
	throttledTo, throttledFrom atomic.Int64
}

// limiterKey names a bucket: a sandbox, a direction, and the cap (a
// configuration with another cap gets buckets of its own).
type limiterKey struct {
	sandbox string
	dir     splice.Direction
	cap     Bandwidth
}

type limiterEntry struct {
	lim  *splice.RateLimiter
	refs int
}

// acquire returns the bucket of key, made on first use; release gives it
// back when the tunnel ends.
func (t *limiterTable) acquire(key limiterKey) *splice.RateLimiter {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.buckets == nil {
		t.buckets = map[limiterKey]*limiterEntry{}
	}
	e := t.buckets[key]
	if e == nil {
		lim := splice.NewRateLimiter(key.cap.BytesPerSecond, key.cap.burst())
		if tokens, ok := t.seeds[key]; ok {
			lim = splice.NewRateLimiterHolding(key.cap.BytesPerSecond, key.cap.burst(), tokens)
			delete(t.seeds, key)
		}
		e = &limiterEntry{lim: lim}
		t.buckets[key] = e
	}
	e.refs++
	return e.lim
}

func (t *limiterTable) release(key limiterKey) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if e := t.buckets[key]; e != nil {
		if e.refs--; e.refs == 0 {
			delete(t.buckets, key)
		}
	}
}

// limits returns the relay limits of a tunnel to sandbox under the caps,
// and the function that releases them when the tunnel ends.
func (r *Registry) limits(sandbox string, toSandbox, fromSandbox Bandwidth) (lim [2]splice.Limiter, release func()) {
	var keys []limiterKey
	for d, c := range map[splice.Direction]Bandwidth{splice.AToB: toSandbox, splice.BToA: fromSandbox} {
		if c.BytesPerSecond > 0 {
			k := limiterKey{sandbox: sandbox, dir: d, cap: c}
			lim[d] = r.bandwidth.acquire(k)
			keys = append(keys, k)
		}
	}
	return lim, func() {
		for _, k := range keys {
			r.bandwidth.release(k)
		}
	}
}

// Throttled is how long the directions of closed tunnels waited for their
// sandbox's bandwidth cap (Config.BandwidthToSandbox, BandwidthFromSandbox).
func (r *Registry) Throttled() (toSandbox, fromSandbox time.Duration) {
	return time.Duration(r.bandwidth.throttledTo.Load()), time.Duration(r.bandwidth.throttledFrom.Load())
}

// BucketState is one sandbox bucket's level as it moves to another
// process (ReportState.Buckets).
type BucketState struct {
	Sandbox        string           `json:"sandbox"`
	Direction      splice.Direction `json:"direction"`
	BytesPerSecond int64            `json:"bytes_per_second"`
	Burst          int64            `json:"burst"`
	Tokens         int64            `json:"tokens"`
}

// take empties every bucket and returns their levels, and the function
// that gives them back.
func (t *limiterTable) take() ([]BucketState, func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []BucketState
	var lims []*splice.RateLimiter
	for k, e := range t.buckets {
		out = append(out, BucketState{Sandbox: k.sandbox, Direction: k.dir, BytesPerSecond: k.cap.BytesPerSecond, Burst: k.cap.Burst, Tokens: e.lim.TakeTokens()})
		lims = append(lims, e.lim)
	}
	return out, func() {
		for i, l := range lims {
			l.PutTokens(out[i].Tokens)
		}
	}
}

// seed makes the buckets of bs start from their levels when first used.
func (t *limiterTable) seed(bs []BucketState) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, b := range bs {
		if t.seeds == nil {
			t.seeds = map[limiterKey]int64{}
		}
		t.seeds[limiterKey{sandbox: b.Sandbox, dir: b.Direction, cap: Bandwidth{BytesPerSecond: b.BytesPerSecond, Burst: b.Burst}}] = b.Tokens
	}
}

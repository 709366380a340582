package forward

import (
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// A sandbox's cap is shared by its tunnels (two tunnels move at the
// sandbox's rate together) and by no other sandbox (a tunnel of another
// sandbox has a bucket of its own); every byte arrives exact and the waits
// are counted.
func TestBandwidthCapPerSandbox(t *testing.T) {
	const rate, size = 2 << 20, 1 << 20
	up := forwardtest.NewSizedUpstream(t, func(int) int64 { return 0 })
	f := newFixture(t, func(c *Config) { c.BandwidthToSandbox = Bandwidth{BytesPerSecond: rate} })
	var wg sync.WaitGroup
	for i, sandbox := range []string{"sbx-a", "sbx-a", "sbx-b"} {
		wg.Go(func() { runTunnel(t, f.dial(t), f.gw.Frame(t, sandbox, up.Addr()), size, uint64(i+1)) })
	}
	wg.Wait()
	for _, err := range f.wait(t, 3) {
		if err != nil {
			t.Errorf("tunnel: %v", err)
		}
	}
	// How long each sandbox's tunnels ran together: from the first
	// registration to the last end.
	first, last := map[string]time.Time{}, map[string]time.Time{}
	f.mu.Lock()
	for _, r := range f.res {
		sb, opened := r.Tunnel.Sandbox, r.Tunnel.Opened
		if f, ok := first[sb]; !ok || opened.Before(f) {
			first[sb] = opened
		}
		if end := opened.Add(r.Duration); end.After(last[sb]) {
			last[sb] = end
		}
	}
	f.mu.Unlock()
	took := map[string]time.Duration{}
	for sb := range first {
		took[sb] = last[sb].Sub(first[sb])
	}
	up.Close()
	sums := map[[32]byte]bool{}
	for _, r := range up.Results() {
		sums[r.RecvSum] = r.Received == size
	}
	for i := range 3 {
		if !sums[forwardtest.PatternSum(uint64(i+1), size)] {
			t.Errorf("tunnel %d's bytes did not arrive exact", i)
		}
	}
	// sbx-a: 2 MiB through one 2 MiB/s bucket, less its burst (64 KiB
	// floor, a tenth of a second's worth: 204 KiB).
	floorA := time.Duration((2*size - rate/10) * int64(time.Second) / rate)
	if took["sbx-a"] < floorA {
		t.Errorf("sbx-a's two tunnels finished in %v: faster than its cap allows (%v)", took["sbx-a"], floorA)
	}
	// sbx-b: 1 MiB through a bucket of its own.
	floorB := time.Duration((size - rate/10) * int64(time.Second) / rate)
	if took["sbx-b"] < floorB || took["sbx-b"] > floorA {
		t.Errorf("sbx-b's tunnel took %v: want its own bucket's pace (between %v and %v)", took["sbx-b"], floorB, floorA)
	}
	if to, from := f.reg.Throttled(); to == 0 || from != 0 {
		t.Errorf("throttled %v to and %v from the sandboxes, want some to and none from", to, from)
	}
	f.reg.bandwidth.mu.Lock()
	left := len(f.reg.bandwidth.buckets)
	f.reg.bandwidth.mu.Unlock()
	if left != 0 {
		t.Errorf("%d buckets left after the tunnels closed", left)
	}
}

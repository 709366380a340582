package handoff

import (
	"math"
	"runtime/debug"
	"runtime/metrics"
)

// A collection of the Go heap marks everything the process holds: in a
// forwarder with thousands of tunnels, their relays' goroutines and
// buffers. One that lands in a handoff stops every relay behind it: moving
// 10,000 idle tunnels cost some 40 % more CPU per tunnel, and its pauses'
// p99 tripled, when one did (docs/bench/upgrade.md). A handoff allocates
// little, some kilobytes per object on each side, so it holds collections
// off while it moves, up to a memory limit.

// CollectionHeadroom is what HoldCollection lets the heap grow by before
// the collector runs all the same: some 7 KB per tunnel on each side makes
// it room for tens of thousands of tunnels.
const CollectionHeadroom = 256 << 20

// HoldCollection turns the Go collector off (debug.SetGCPercent(-1)), with
// a memory limit of the process's memory now plus headroom, or the limit
// already set if lower, as the collector's trigger meanwhile; release
// restores both settings. Holds must not overlap.
func HoldCollection(headroom uint64) (release func()) {
	sample := []metrics.Sample{{Name: "/memory/classes/total:bytes"}}
	metrics.Read(sample)
	limit := int64(math.MaxInt64)
	if sample[0].Value.Kind() == metrics.KindUint64 {
		if v := sample[0].Value.Uint64() + headroom; v < math.MaxInt64 {
			limit = int64(v)
		}
	}
	oldLimit := debug.SetMemoryLimit(-1) // reads it
	debug.SetMemoryLimit(min(oldLimit, limit))
	oldPercent := debug.SetGCPercent(-1)
	return func() {
		debug.SetGCPercent(oldPercent)
		debug.SetMemoryLimit(oldLimit)
	}
}

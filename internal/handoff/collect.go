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
// p99 tripled or more, when one did (docs/bench/upgrade.md). A handoff
// allocates some kilobytes per tunnel on each side, so it holds
// collections off while it moves, up to a memory limit.

// CollectionHeadroom is what HoldCollection lets the process's memory grow
// by before the collector runs all the same. A move grows its processes by
// some 20 KB per tunnel on plain TCP and 47 KB with kernel TLS, both sides
// together (docs/bench/upgrade.md), and the collector starts well before
// the limit (while it marks, the process goes on allocating): 256 MiB let
// one run in the middle of a 10,000-tunnel move. It is a ceiling: a move
// grows the process by what it needs, and a lower GOMEMLIMIT stays the
// limit.
const CollectionHeadroom = 1 << 30

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

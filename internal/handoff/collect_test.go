package handoff

import (
	"math"
	"runtime/debug"
	"testing"
)

// HoldCollection turns the collector off under a memory limit above what
// the process holds, keeps a lower limit set before, and restores both.
func TestHoldCollection(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(77))
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(math.MaxInt64))

	release := HoldCollection(64 << 20)
	if p := debug.SetGCPercent(-1); p != -1 {
		t.Errorf("held: GC percent %d, want -1 (off)", p)
	}
	if lim := debug.SetMemoryLimit(-1); lim == math.MaxInt64 || lim < 64<<20 {
		t.Errorf("held: memory limit %d, want what the process holds plus 64 MiB", lim)
	}
	release()
	if p := debug.SetGCPercent(77); p != 77 {
		t.Errorf("released: GC percent %d, want 77 back", p)
	}
	if lim := debug.SetMemoryLimit(-1); lim != math.MaxInt64 {
		t.Errorf("released: memory limit %d, want none back", lim)
	}

	debug.SetMemoryLimit(32 << 20)
	release = HoldCollection(64 << 20)
	if lim := debug.SetMemoryLimit(-1); lim != 32<<20 {
		t.Errorf("held under a lower limit: %d, want that limit kept", lim)
	}
	release()
	if lim := debug.SetMemoryLimit(-1); lim != 32<<20 {
		t.Errorf("released: memory limit %d, want 32 MiB back", lim)
	}
}

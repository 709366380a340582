package ktls

import (
	"slices"
	"testing"
)

// TestReasonsIsACopy: Reasons lists each reason once, and a caller that
// changes the returned slice does not change what the next call returns.
func TestReasonsIsACopy(t *testing.T) {
	got := Reasons()
	if len(got) != len(slices.Compact(slices.Sorted(slices.Values(got)))) {
		t.Fatalf("Reasons() repeats a reason: %v", got)
	}
	for _, r := range []Reason{ReasonNone, ReasonRXDisabled, ReasonHandshakeFailed} {
		if !slices.Contains(got, r) {
			t.Errorf("Reasons() lacks %q", r)
		}
	}
	got[0] = "changed"
	if again := Reasons(); again[0] == "changed" {
		t.Error("Reasons() returns the package's own slice")
	}
}

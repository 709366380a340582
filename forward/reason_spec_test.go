package forward

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReasonsInSpec: docs/preamble.md §7 names every reason the forwarder
// raises itself (Reasons), each in backquotes, in its paragraph on the
// forwarder's own reasons, so that the spec's list cannot omit one
// (wake-failed was missing).
func TestReasonsInSpec(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "docs", "preamble.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, sec7, ok := strings.Cut(string(doc), "\n## 7. ")
	if !ok {
		t.Fatal("docs/preamble.md has no section 7")
	}
	sec7, _, _ = strings.Cut(sec7, "\n## ")
	_, own, ok := strings.Cut(sec7, "adds its own reasons")
	if !ok {
		t.Fatal("docs/preamble.md §7 has no paragraph on the forwarder's own reasons")
	}
	own, _, _ = strings.Cut(own, "\n\n")
	for _, r := range Reasons() {
		if !strings.Contains(own, "`"+string(r)+"`") {
			t.Errorf("docs/preamble.md §7 does not name the forwarder's reason %q", r)
		}
	}
}

package main

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

const syntheticTTFB, syntheticTTFBGolden = "testdata/synthetic-ttfb.json", "testdata/synthetic-ttfb.golden.md"

func readSyntheticTTFB(t *testing.T) *benchjson.TTFBReport {
	t.Helper()
	data, err := os.ReadFile(syntheticTTFB)
	if err != nil {
		t.Fatal(err)
	}
	r, err := parseTTFB(data)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// The ttfb report of the synthetic run is byte-identical to its golden
// file (go test -update rewrites it; review the diff).
func TestTTFBReportGolden(t *testing.T) {
	r := readSyntheticTTFB(t)
	got := renderTTFBMarkdown(r, syntheticTTFB)
	if *updateGolden {
		if err := os.WriteFile(syntheticTTFBGolden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(syntheticTTFBGolden)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("the ttfb report differs from %s (go test -run TestTTFBReportGolden -update rewrites it):\n%s", syntheticTTFBGolden, got)
	}
	if again := renderTTFBMarkdown(r, syntheticTTFB); !bytes.Equal(again, got) {
		t.Error("rendering twice gave two reports")
	}
}

// The goal's verdict follows the figures at 20 ms: met while l4-l4 with
// standby is at most l7-l7, missed by the difference above it, and not
// claimed either way without both, or with the path check at 20 ms failed.
func TestTTFBGoalVerdict(t *testing.T) {
	goal := func(r *benchjson.TTFBReport) string {
		md := string(renderTTFBMarkdown(r, syntheticTTFB))
		_, after, ok := strings.Cut(md, "## The goal")
		if !ok {
			t.Fatal("no goal section")
		}
		section, _, _ := strings.Cut(after, "\n## ")
		return section
	}
	r := readSyntheticTTFB(t)
	if s := goal(r); !strings.Contains(s, "- p50: 48.6 against 49.5 ms (×0.98): **met, by 0.90 ms**.") {
		t.Errorf("synthetic run's goal section:\n%s", s)
	}
	ttfbResult(r, "l4-l4-standby", 20).P50Ms = 52.0
	if s := goal(r); !strings.Contains(s, "- p50: 52.0 against 49.5 ms (×1.05): **missed, by 2.50 ms**.") {
		t.Errorf("with standby slower, the goal section:\n%s", s)
	}
	ttfbPath(r, 20).OK = false
	if s := goal(r); !strings.Contains(s, "Not measured in this run.") || strings.Contains(s, "met") {
		t.Errorf("with the path check at 20 ms failed, the goal section:\n%s", s)
	}
	r = readSyntheticTTFB(t)
	r.Results = r.Results[:1]
	if s := goal(r); !strings.Contains(s, "Not measured in this run.") {
		t.Errorf("without 20 ms, the goal section:\n%s", s)
	}
}

// The round trips across the path are the p50's slope between the lowest
// and the highest RTT.
func TestTTFBRoundTrips(t *testing.T) {
	md := string(renderTTFBMarkdown(readSyntheticTTFB(t), syntheticTTFB))
	for _, row := range []string{
		"| `l7-l7` | 30.2 | 49.5 | 1.02 |",         // (49.5 − 30.2) / 19
		"| `l4-l4` | 34.0 | 91.7 | 3.04 |",         // (91.7 − 34.0) / 19
		"| `l4-l4-standby` | 29.1 | 48.6 | 1.03 |", // (48.6 − 29.1) / 19
	} {
		if !strings.Contains(md, row) {
			t.Errorf("no row %q in the report", row)
		}
	}
}

// A document of another kind is refused, not rendered as a ttfb run.
func TestParseTTFBRefusesOtherKinds(t *testing.T) {
	for _, name := range []string{"testdata/synthetic-load.json", "testdata/synthetic-results.json"} {
		data, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := parseTTFB(data); err == nil {
			t.Errorf("%s parsed as a ttfb run", name)
		}
	}
}

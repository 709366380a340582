package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden reports under testdata/ from the renderer")

// The load report of the synthetic run is byte-identical to its golden
// file (go test -update rewrites it; review the diff).
func TestLoadReportGolden(t *testing.T) {
	const in, golden = "testdata/synthetic-load.json", "testdata/synthetic-load.golden.md"
	l := readSyntheticLoad(t, in)
	got := renderLoadMarkdown(l, in)
	if *updateGolden {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("the load report differs from %s (go test -run TestLoadReportGolden -update rewrites it):\n%s", golden, got)
	}
	if again := renderLoadMarkdown(l, in); !bytes.Equal(again, got) {
		t.Error("rendering twice gave two reports")
	}
}

// A document of another kind is refused, not rendered as a load run.
func TestParseLoadRefusesOtherKinds(t *testing.T) {
	data, err := os.ReadFile("testdata/synthetic-results.json")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := parseLoad(data); err == nil {
		t.Error("a results document parsed as a load run")
	}
}

// A run that recorded the contender's memory shows it in one more column
// of the per-step tables, "–" in a step without it; the rest of the
// report is the one without memory (the golden file's), line for line.
func TestLoadReportContenderMemory(t *testing.T) {
	const in, golden = "testdata/synthetic-load.json", "testdata/synthetic-load.golden.md"
	l := readSyntheticLoad(t, in)
	ktls := l.Results[0]
	ktls.Unloaded.ContenderRSS, ktls.Unloaded.ContenderFDs = 3<<20+1<<19, 25
	ktls.Steps[1].ContenderRSS, ktls.Steps[1].ContenderFDs = 812<<20, 10071
	ktls.Fairness.ContenderFDs = 9 // fds without RSS
	got := strings.Split(string(renderLoadMarkdown(l, in)), "\n")
	wantData, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Split(string(wantData), "\n")
	if len(got) != len(want) {
		t.Fatalf("%d lines, the report without memory has %d", len(got), len(want))
	}
	cells := map[string]string{
		"| unloaded | 10 | – | 100 | 100 | 10.0 | 0.90 |": "3.5 / 25",
		"| sweep | 600 | 200 |":                           "812.0 / 10071",
		"| +2 bulk | 300 |":                               "– / 9",
	}
	var headers, rows int
	for i := range got {
		added, ok := strings.CutPrefix(got[i], want[i])
		switch {
		case !ok:
			t.Errorf("line %d:\n got  %s\n want %s (and a column)", i+1, got[i], want[i])
		case added == "":
		case strings.HasPrefix(want[i], "| step |"):
			headers++
			if added != " cont. RSS MiB / fds |" {
				t.Errorf("line %d: header adds %q", i+1, added)
			}
		case strings.HasPrefix(want[i], "|---|---:|---:|---:|"):
			if added != "---:|" {
				t.Errorf("line %d: alignment adds %q", i+1, added)
			}
		case strings.HasPrefix(want[i], "Latency from each call"):
			if !strings.Contains(added, "*cont. RSS MiB / fds*, is the contender's resident memory and open file descriptors") {
				t.Errorf("line %d: the legend adds %q", i+1, added)
			}
		case strings.HasPrefix(want[i], "| "):
			rows++
			cell := "–"
			for prefix, c := range cells {
				if strings.HasPrefix(want[i], prefix) {
					cell = c
				}
			}
			if added != " "+cell+" |" {
				t.Errorf("line %d: row %s adds %q, want %q", i+1, want[i], added, " "+cell+" |")
			}
		default:
			t.Errorf("line %d adds %q", i+1, added)
		}
	}
	if headers != len(l.Results) || rows != 9 {
		t.Errorf("the column is in %d tables and %d rows, want %d tables and 9 rows", headers, rows, len(l.Results))
	}
}

// A reuse result that recorded the contender's memory before its tunnels
// gets a row in "Memory of the tunnels held": the step where RSS peaked,
// and the growth per tunnel held (params.tunnels); a result without the
// before figures gets none, and a run where none has them no section.
func TestLoadReportMemoryHeld(t *testing.T) {
	l := readSyntheticLoad(t, "testdata/synthetic-load.json")
	if md := string(renderLoadMarkdown(l, "x")); strings.Contains(md, "## Memory of the tunnels held") {
		t.Error("a run without the before figures has a memory section")
	}
	ktls := l.Results[0]
	ktls.RSSBefore, ktls.FDsBefore = 40<<20, 12
	ktls.Unloaded.ContenderRSS, ktls.Unloaded.ContenderFDs = 45<<20, 212
	ktls.Steps[0].ContenderRSS, ktls.Steps[0].ContenderFDs = 50<<20, 216 // the peak: 10 MiB over 100 tunnels
	ktls.Steps[1].ContenderRSS, ktls.Steps[1].ContenderFDs = 48<<20, 214
	md := string(renderLoadMarkdown(l, "x"))
	_, section, ok := strings.Cut(md, "## Memory of the tunnels held\n")
	if !ok {
		t.Fatalf("no memory section:\n%s", md)
	}
	section, _, _ = strings.Cut(section, "\n## ")
	var rows []string
	for line := range strings.SplitSeq(section, "\n") {
		if strings.HasPrefix(line, "| `") {
			rows = append(rows, line)
		}
	}
	want := fmt.Sprintf("| `ktls` | 40.0 | 50.0 | %.0f | 102.4 | 12 | 216 | 2.04 |", ktls.Steps[0].Rate)
	if len(rows) != 1 || rows[0] != want {
		t.Errorf("memory rows %q, want only %q", rows, want)
	}
	if !strings.Contains(section, "holds 100 tunnels open") {
		t.Errorf("the section does not say how many tunnels were held:\n%s", section)
	}
}

// readSyntheticLoad parses the load run in the file named.
func readSyntheticLoad(t *testing.T, name string) *benchjson.LoadReport {
	t.Helper()
	data, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	l, err := parseLoad(data)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

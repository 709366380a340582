package main

import (
	"bytes"
	"flag"
	"os"
	"testing"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden reports under testdata/ from the renderer")

// The load report of the synthetic run is byte-identical to its golden
// file (go test -update rewrites it; review the diff).
func TestLoadReportGolden(t *testing.T) {
	const in, golden = "testdata/synthetic-load.json", "testdata/synthetic-load.golden.md"
	data, err := os.ReadFile(in)
	if err != nil {
		t.Fatal(err)
	}
	l, err := parseLoad(data)
	if err != nil {
		t.Fatal(err)
	}
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

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
	if strings.Contains(section, "| process |") {
		t.Error("a run without go_memory has a Go runtime table")
	}

	// With the Go runtime's figures: a row per process.
	ktls.GoMemory = []benchjson.GoMemory{{Name: "forwarder", HeapLive: 16.4 * 1024, HeapInuse: 25.4 * 1024, Stacks: 20 * 1024, Goroutines: 2}}
	md = string(renderLoadMarkdown(l, "x"))
	_, section, _ = strings.Cut(md, "## Memory of the tunnels held\n")
	section, _, _ = strings.Cut(section, "\n## ")
	if want := "| `ktls` | forwarder | 16.4 | 25.4 | 20.0 | 2.00 |"; !strings.Contains(section, want+"\n") {
		t.Errorf("the memory section has no row %q:\n%s", want, section)
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

// A chain run's report is byte-identical to its golden file (go test
// -update rewrites it; review the diff).
func TestLoadGatewayReportGolden(t *testing.T) {
	const in, golden = "testdata/synthetic-load-gateway.json", "testdata/synthetic-load-gateway.golden.md"
	got := renderLoadMarkdown(readSyntheticLoad(t, in), in)
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
		t.Errorf("the chain load report differs from %s (go test -run TestLoadGatewayReportGolden -update rewrites it):\n%s", golden, got)
	}
}

// A chain's rows say whose CPU was busy summed over its processes with
// each one's share, each step's figures per process, the failures each
// process counted (not its ok dials, resumptions or orderly ends), the
// user connections' handshakes, and the comparison with l7-l7 in the
// same shape.
func TestLoadGatewayReportRows(t *testing.T) {
	md := string(renderLoadMarkdown(readSyntheticLoad(t, "testdata/synthetic-load-gateway.json"), "x"))
	for _, want := range []string{
		// At 100 %: 0.45 + 0.45 = 0.90 of the contender's one CPU.
		"| `l4-l4` | per-call | 10.0 | ≥ 150 (no search step failed) | contender (gen 0.50, cont. 0.90 = gateway 0.45 + forwarder 0.45) | 0.93 (generator busy at 200 %: gen 0.90) | reset 20 | 2001 handshakes, 2000 resumed | TX kernel",
		"| `l7-l7` | per-call | 20.0 | ≥ 100 (no search step failed) | contender (gen 0.50, cont. 0.90 = gateway 0.50 + forwarder 0.40) | 0.40 (generator busy at 200 %: gen 0.90) | gateway 12, timeout 3 | 1001 handshakes, 1000 resumed |",
		"| sweep | 300 | 200 | 1500 | 1480 | 140.0 | 233.3 | 700.0 | 800.0 | 800.0 | reset 20 | 0 | 0.10 | 0.90 | 0.95 | 0.5 | 75.0 / 60 | gateway 0.50, 43.0 / 40; forwarder 0.45, 32.0 / 20 |",
		"- `l4-l4` per-call, counted by its processes: gateway caddy_ktls_gateway_dials_total{module=\"layer4.handlers.sandbox_proxy\",result=\"overloaded\"} × 20; forwarder caddy_ktls_handshake_failures_total{module=\"layer4.handlers.ktls\",reason=\"overloaded\"} × 20\n",
		"- `l4-l4` per-call: reset: gateway: reset in first-read × 20\n",
		// l4-l4 against l7-l7: capacity 150 ÷ 100, p99 20 ÷ 40 ms at 50 %,
		// 45 ÷ 60 ms at 80 %; CPU per call at 100 %: 0.90 cores ÷ 150/s.
		"| `l4-l4` | per-call | 150 | ×1.50 | 20.0 | ×0.50 | 25.0 | 45.0 | ×0.75 | 50.0 | 0.93 (generator busy at 200 %: gen 0.90) | reset 20 | 6.0 (gateway 3.0 + forwarder 3.0) | 2001 handshakes, 2000 resumed | 2575 (2574) |",
		"| `l7-l7` | per-call | 100 | ×1.00 | 40.0 | ×1.00 | 50.0 | 60.0 | ×1.00 | 70.0 | 0.40 (generator busy at 200 %: gen 0.90) | gateway 12, timeout 3 | 9.0 (gateway 5.0 + forwarder 4.0) | 1001 handshakes, 1000 resumed | – |",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("the report lacks %q:\n%s", want, md)
		}
	}
	if strings.Contains(md, `result=\"ok\"} ×`) || strings.Contains(md, "dials_resumed_total{module=\"layer4.handlers.sandbox_proxy\"} ×") {
		t.Error("ok dials or resumptions listed as failures")
	}
}

// A run of one-process contenders shows no chain figures: no section, no
// per-process column, no CPU shares.
func TestLoadReportWithoutChains(t *testing.T) {
	md := string(renderLoadMarkdown(readSyntheticLoad(t, "testdata/synthetic-load.json"), "x"))
	for _, absent := range []string{"## The gateway chains", "per hop", " = gateway", "user TLS"} {
		if strings.Contains(md, absent) {
			t.Errorf("a run without chains shows %q", absent)
		}
	}
}

// A process's counter series is listed as a failure unless it counts
// what went right: an ok dial, a resumption, a tunnel closed in order, a
// standby connection used, a handshake or a direction offloaded.
func TestFailureSeries(t *testing.T) {
	for series, want := range map[string]bool{
		`caddy_ktls_gateway_dials_total{module="m",result="ok"}`:               false,
		`caddy_ktls_gateway_dials_total{module="m",result="overloaded"}`:       true,
		`caddy_ktls_gateway_dials_resumed_total{module="m"}`:                   false,
		`caddy_ktls_gateway_tunnel_ends_total{end="closed",module="m"}`:        false,
		`caddy_ktls_gateway_tunnel_ends_total{end="refused",module="m"}`:       true,
		`caddy_ktls_gateway_standby_total{module="m",outcome="used"}`:          false,
		`caddy_ktls_gateway_standby_total{module="m",outcome="lost"}`:          true,
		`caddy_ktls_handshakes_total{module="m",reason="none"}`:                false,
		`caddy_ktls_handshakes_total{module="m",reason="handshake-failed"}`:    true,
		`caddy_ktls_offload_directions_total{direction="tx",mode="sw"}`:        false,
		`caddy_ktls_offload_directions_total{direction="rx",mode="userspace"}`: true,
		`caddy_ktls_connections_closed_total{event="alert",module="m"}`:        true,
		`caddy_ktls_handshake_failures_total{module="m",reason="overloaded"}`:  true,
		`caddy_ktls_sandbox_rejects_total{reason="overloaded"}`:                true,
	} {
		if got := isFailureSeries(series); got != want {
			t.Errorf("%s: failure %v, want %v", series, got, want)
		}
	}
}

// The goodput ratio is marked where the generator was busy at 200 % (its
// lateness is then in every call's latency, and the ratio is not the
// contender's), in the forwarder rows and the chain rows, and only there.
func TestGoodputMarkedWhereTheGeneratorWasBusy(t *testing.T) {
	at100 := &benchjson.Step{Pct: 100, Goodput: 100, GenCPU: 0.5}
	for _, tc := range []struct {
		gen  float64
		cpus int
		want string
	}{
		{0.84, 1, "0.36"},
		{0.85, 1, "0.36 (generator busy at 200 %: gen 0.85)"},
		{0.95, 0, "0.36 (generator busy at 200 %: gen 0.95)"},
		{1.60, 2, "0.36"},
		{1.70, 2, "0.36 (generator busy at 200 %: gen 1.70)"},
	} {
		at200 := &benchjson.Step{Pct: 200, Goodput: 36, GenCPU: tc.gen}
		if got := goodputCell(at100, at200, tc.cpus); got != tc.want {
			t.Errorf("gen %.2f of %d CPUs: %q, want %q", tc.gen, tc.cpus, got, tc.want)
		}
	}
	if got := goodputCell(&benchjson.Step{Pct: 100}, &benchjson.Step{Pct: 200, Goodput: 5}, 1); got != "" {
		t.Errorf("no goodput at 100 %%: %q, want no ratio", got)
	}
	if got := goodputCell(nil, &benchjson.Step{Pct: 200, Goodput: 5}, 1); got != "" {
		t.Errorf("no step at 100 %%: %q, want no ratio", got)
	}

	for _, in := range []string{"testdata/synthetic-load.json", "testdata/synthetic-load-gateway.json"} {
		l := readSyntheticLoad(t, in)
		for _, r := range l.Results {
			if s := sweepStep(r, 200); s != nil {
				s.GenCPU = 0.97 * float64(max(l.CPUs, 1))
			}
		}
		md := string(renderLoadMarkdown(l, in))
		marked := fmt.Sprintf("(generator busy at 200 %%: gen %.2f)", 0.97*float64(max(l.CPUs, 1)))
		if !strings.Contains(md, marked) {
			t.Errorf("%s, the generator busy at 200 %%: no ratio marked:\n%s", in, md)
		}
		for _, r := range l.Results {
			if s := sweepStep(r, 200); s != nil {
				s.GenCPU = 0.84 * float64(max(l.CPUs, 1))
			}
		}
		if md := string(renderLoadMarkdown(l, in)); strings.Contains(md, "generator busy at 200 %") {
			t.Errorf("%s: a ratio marked though the generator was not busy:\n%s", in, md)
		}
	}
}

package main

import (
	"bytes"
	"image"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The fixtures under testdata/ are synthetic: invented numbers chosen so that
// every ratio below is easy to check by hand (and some goals are missed).

func loadFixture(t *testing.T) *Results {
	t.Helper()
	data, err := os.ReadFile("testdata/synthetic-results.json")
	if err != nil {
		t.Fatal(err)
	}
	r, err := parseResults(data)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

// requireIn fails t unless the report md (named what) contains want.
func requireIn(t *testing.T, what, md, want string) {
	t.Helper()
	if !strings.Contains(md, want) {
		t.Errorf("%s lacks %q\n%s", what, want, md)
	}
}

func shapeOf(t *testing.T, r *Results, shape string) shapeTable {
	t.Helper()
	for _, st := range r.tables() {
		if st.shape == shape {
			return st
		}
	}
	t.Fatalf("no shape %q", shape)
	return shapeTable{}
}

func TestDerivedFigures(t *testing.T) {
	r := loadFixture(t)
	up := shapeOf(t, r, "upload")
	var order []string
	for _, res := range up.rows {
		order = append(order, res.Contender)
	}
	if got, want := strings.Join(order, " "), "ktls ktls-off l4-proxy reverse-proxy haproxy nginx floor-ktls floor-plain"; got != want {
		t.Errorf("upload rows %q, want %q", got, want)
	}
	k := up.by["ktls"]
	for _, c := range []struct {
		name string
		got  func() (float64, bool)
		want float64
	}{
		{"ktls above floor", func() (float64, bool) { return up.aboveFloor(k) }, 0.05},
		{"l4-proxy above floor", func() (float64, bool) { return up.aboveFloor(up.by["l4-proxy"]) }, 1.0},
		{"ktls above floor / l4-proxy's", func() (float64, bool) { return up.aboveFloorRatio(k, "l4-proxy") }, 0.05},
		{"ktls above floor / reverse-proxy's", func() (float64, bool) { return up.aboveFloorRatio(k, "reverse-proxy") }, 0.02},
		{"ktls CPU / l4-proxy's", func() (float64, bool) { return up.cpuRatio(k, "l4-proxy") }, 0.45 / 1.40},
		{"floor-plain below the floor", func() (float64, bool) { return up.aboveFloor(up.by["floor-plain"]) }, -0.29},
		// nginx has runs but no summary: the median comes from its runs.
		{"nginx from runs", func() (float64, bool) { return up.by["nginx"].cpu().Median, true }, 1.0},
	} {
		got, ok := c.got()
		if !ok || !near(got, c.want) {
			t.Errorf("%s = %v (ok %v), want %v", c.name, got, ok, c.want)
		}
	}
	if _, ok := up.aboveFloor(up.by["haproxy"]); ok {
		t.Error("haproxy has no CPU figure but got an overhead")
	}
	if _, ok := up.aboveFloorRatio(up.by["haproxy"], "l4-proxy"); ok {
		t.Error("haproxy has no CPU figure but got a ratio")
	}
	small := shapeOf(t, r, "small-reuse")
	if got, ok := small.callsRatio(small.by["ktls"], "l4-proxy"); !ok || !near(got, 2) {
		t.Errorf("small-reuse calls/CPU-s ratio = %v, want 2", got)
	}
	if _, ok := small.callsRatio(small.by["ktls"], "reverse-proxy"); ok {
		t.Error("a ratio to a contender that was not run")
	}
}

func TestGoals(t *testing.T) {
	got := map[string]string{}
	for _, g := range goals(loadFixture(t).tables()) {
		got[g.goal] = g.status + " / " + g.measured
	}
	for goal, want := range map[string]string{
		"fast path: 0 payload bytes through userspace per GiB (upload)": met + " / ktls 0 B/GiB − floor-ktls 0 B/GiB (handshakes) = 0 B/GiB (preambles); l4-proxy 2 GiB/GiB",
		// 4 KiB/GiB beyond the floor: a preamble, not payload.
		"fast path: 0 payload bytes through userspace per GiB (download)": met + " / ktls 4 KiB/GiB − floor-ktls 0 B/GiB (handshakes) = 4 KiB/GiB (preambles); l4-proxy 2 GiB/GiB",
		// Both upload cells were counted untraced: the goal takes that count.
		"syscalls/GiB ≤ 0.1 × l4-proxy's (upload)": met + " / untraced 30 vs 60000: ×0.0005; under strace 40 vs 65536: ×0.00061; data syscalls alone 32 vs 32768: ×0.000977",
		// No data syscall counts on download: the total alone.
		"syscalls/GiB ≤ 0.1 × l4-proxy's (download)":                   met + " / 50 vs 65536: ×0.000763",
		"CPU above the crypto floor ≤ 0.1 × l4-proxy's (upload)":       met + " / +0.05 vs +1 CPU-s/GiB: ×0.05",
		"CPU above the crypto floor ≤ 0.05 × reverse-proxy's (upload)": met + " / +0.05 vs +2.5 CPU-s/GiB: ×0.02",
		// 0.10 above the floor against l4-proxy's 0.80: ×0.125.
		"CPU above the crypto floor ≤ 0.1 × l4-proxy's (download)":       missed + " / +0.1 vs +0.8 CPU-s/GiB: ×0.125",
		"CPU above the crypto floor ≤ 0.05 × reverse-proxy's (download)": met + " / +0.1 vs +2 CPU-s/GiB: ×0.05",
		"idle tunnel ≤ 16 KiB heap, no pipe held":                        "see idle.md / [idle.md](idle.md)",
	} {
		if got[goal] != want {
			t.Errorf("goal %q:\n got %q\nwant %q", goal, got[goal], want)
		}
	}
}

// The small-call goals (issue 18): on reused connections against the best
// userspace peer, calls per CPU-second (higher is better) and p99 (lower
// is better); with a connection per call against l4-proxy and
// reverse-proxy.
func TestSmallGoals(t *testing.T) {
	cell := func(contender, shape string, calls, p99 float64) Result {
		return Result{Contender: contender, Shape: shape, CallsPerCPUS: Summary{Median: calls}, P99US: p99}
	}
	r := &Results{Results: []Result{
		cell("ktls", "small-reuse", 13000, 4000),
		cell("l4-proxy", "small-reuse", 10000, 5000),
		cell("haproxy", "small-reuse", 10500, 3900),
		cell("nginx", "small-reuse", 9000, 4500),
		// Not a peer: the floor never sets the bar.
		cell("floor-ktls", "small-reuse", 20000, 100),
		cell("ktls", "small-per-call-resumed", 300, 0),
		cell("l4-proxy", "small-per-call-resumed", 290, 0),
		cell("reverse-proxy", "small-per-call-resumed", 240, 0),
	}}
	got := map[string]string{}
	for _, g := range goals(r.tables()) {
		got[g.goal] = g.status + " / " + g.measured
	}
	for goal, want := range map[string]string{
		// 13000 / 10500 = ×1.24.
		"calls/CPU-s ≥ 1.2 × the best userspace peer's (small-reuse)": met + " / ktls 13000 vs best peer haproxy 10500 calls/CPU-s: ×1.24",
		"p99 ≤ the best userspace peer's (small-reuse)":               missed + " / ktls 4000 µs vs best peer haproxy 3900 µs: ×1.03",
		"calls/CPU-s ≥ 1 × l4-proxy's (small-per-call-resumed)":       met + " / ktls 300 vs l4-proxy 290 calls/CPU-s: ×1.03",
		// 300 / 240 = ×1.25.
		"calls/CPU-s ≥ 1.2 × reverse-proxy's (small-per-call-resumed)": met + " / ktls 300 vs reverse-proxy 240 calls/CPU-s: ×1.25",
	} {
		if got[goal] != want {
			t.Errorf("goal %q:\n got %q\nwant %q", goal, got[goal], want)
		}
	}
}

// A contender under the floor's median has no overhead ratio to show, and
// meets the overhead goals.
func TestUnderTheFloor(t *testing.T) {
	r := loadFixture(t)
	for i := range r.Results {
		if res := &r.Results[i]; res.Contender == "ktls" && res.Shape == "upload" {
			res.CPUPerGiB.Median = 0.39 // the floor's is 0.40
		}
	}
	for _, g := range goals(r.tables()) {
		if g.goal == "CPU above the crypto floor ≤ 0.1 × l4-proxy's (upload)" {
			if want := "-0.01 vs +1 CPU-s/GiB: ≤ 0 (under the floor's median)"; g.status != met || g.measured != want {
				t.Errorf("under the floor: %q, %q; want met, %q", g.status, g.measured, want)
			}
		}
	}
}

// A fast path that copied its payload through userspace misses the goal.
func TestGoalPayloadCopied(t *testing.T) {
	r := loadFixture(t)
	for i := range r.Results {
		if res := &r.Results[i]; res.Contender == "ktls" && res.Shape == "download" {
			res.Structural.UserspaceBytesPerGiB = 1 << 30
		}
	}
	for _, g := range goals(r.tables()) {
		if g.goal == "fast path: 0 payload bytes through userspace per GiB (download)" && g.status != missed {
			t.Errorf("1 GiB/GiB through userspace: %q, %q", g.status, g.measured)
		}
	}
}

func TestResultsMarkdown(t *testing.T) {
	r := loadFixture(t)
	md := string(renderResultsMarkdown(r, []string{"testdata/synthetic-results.json"}, "chart.png"))
	for _, want := range []string{
		"- Mode: vm-icount: qemu TCG with `-icount shift=0`",
		"| `bulk_bytes` | 67108864 (64 MiB) |",
		"SYNTHETIC TEST DATA",
		"`TlsRxSw` 11, `TlsTxSw` 12",
		"## Shape `upload`: bulk transfer, client → sandbox",
		// Every column of ktls on upload, computed from the fixture.
		"| `ktls` | kernel TX+RX | 3 (3 SHA ok) | 0.45 | 6.67 % | +0.05 | ×0.321 | ×0.155 | ×0.05 | ×0.02 | 30 | 40 | 32 | 0 B | 0.05 |",
		// A contender with nothing measured renders dashes, not zeros.
		"| `haproxy` | — | — | — | — | — | — | — | — | — | — | — | — | — | — |",
		"Rendered by `integration/benchreport` from `testdata/synthetic-results.json` (written by `integration/bench.sh`); do not edit by hand. Chart: [chart.png](chart.png).",
		"| `ktls` | kernel TX+RX | 3 (3 SHA ok) | 10000 | 15 % | ×2 | — | 80 | 200 | 4 | 4.5 |",
		"## What this measures and what it cannot",
		"**The harness reported failures**",
		"- `haproxy-lts`: synthetic: not installed",
		"system calls of the forwarder in the traced transfer (synthetic):",
		"- `ktls`, 16 MiB traced: splice 32, epoll_pwait 8",
		// The floors are the reference: no ratio of their overhead.
		"| `floor-ktls` | kernel TX+RX | 3 (3 SHA ok) | 0.4 | 5 % | 0 | ×0.286 | ×0.138 | — | — | — | 40 | — | 0 B | 0.05 |",
		"Untraced syscall counts: a second transfer of the traced size, counted by synthetic counter.",
		"No untraced syscall count:\n\n- `floor-ktls`: synthetic: no tracefs",
		"- `nginx`: synthetic: tls_stat TlsTxSw +1",
	} {
		requireIn(t, "markdown", md, want)
	}
	if again := string(renderResultsMarkdown(loadFixture(t), []string{"testdata/synthetic-results.json"}, "chart.png")); again != md {
		t.Error("the same input rendered two different markdown files")
	}
}

// splitFixture returns the fixture as two runs of one setup: ktls-family
// contenders and the floors in the first, the peers in the second.
func splitFixture(t *testing.T) (*Results, *Results) {
	a, b := loadFixture(t), loadFixture(t)
	a.Results, b.Results = nil, nil
	for _, res := range loadFixture(t).Results {
		if strings.HasPrefix(res.Contender, "ktls") || strings.HasPrefix(res.Contender, "floor-") {
			a.Results = append(a.Results, res)
		} else {
			b.Results = append(b.Results, res)
		}
	}
	b.Date = "2000-01-02T00:00:00Z"
	return a, b
}

// Two runs of one setup merge into the report of the whole: every derived
// figure is the one-run fixture's, the tls_stat deltas add up, and the
// report names both files and what each run measured.
func TestMerge(t *testing.T) {
	a, b := splitFixture(t)
	m, err := mergeResults([]*Results{a, b})
	if err != nil {
		t.Fatal(err)
	}
	whole := loadFixture(t)
	got, want := goals(m.tables()), goals(whole.tables())
	if len(got) != len(want) {
		t.Fatalf("%d goals merged, %d from one run", len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("merged goal %q: %q, one run: %q", got[i].goal, got[i].measured, want[i].measured)
		}
	}
	if m.TLSStatDelta["TlsTxSw"] != 24 || m.TLSStatDelta["TlsRxSw"] != 22 {
		t.Errorf("tls_stat deltas %v, want the two runs' sum (TlsTxSw 24, TlsRxSw 22)", m.TLSStatDelta)
	}
	yes, no := true, false
	for _, c := range []struct {
		a, b, want *bool
	}{{&yes, &yes, &yes}, {&yes, &no, &no}, {nil, &no, &no}, {&yes, nil, nil}} {
		got := allOK([]*Results{{OK: c.a}, {OK: c.b}})
		if (got == nil) != (c.want == nil) || got != nil && *got != *c.want {
			t.Errorf("ok of runs %v, %v: %v, want %v", c.a, c.b, got, c.want)
		}
	}
	if strings.Contains(string(renderResultsMarkdown(m, []string{"a.json", "b.json"}, "")), "- Commit:") {
		t.Error("runs that recorded no commit render a Commit line")
	}
	a.Commit, b.Commit = "0123456789abcdef0123456789abcdef01234567", "0123456789abcdef0123456789abcdef01234567"
	if m, err = mergeResults([]*Results{a, b}); err != nil {
		t.Fatal(err)
	}
	md := string(renderResultsMarkdown(m, []string{"a.json", "b.json"}, ""))
	for _, want := range []string{
		"- Go: ",
		"- Commit: 0123456789abcdef0123456789abcdef01234567\n",
		"from `a.json` and `b.json` (written by `integration/bench.sh`); do not edit by hand.\n",
		"- Date: 2000-01-01T00:00:00Z, 2000-01-02T00:00:00Z",
		"The cells come from 2 runs of the harness",
		"1. 2000-01-01T00:00:00Z: `floor-plain`, `floor-ktls`, `ktls`, `ktls-off`",
		"2. 2000-01-02T00:00:00Z: `l4-proxy`, `reverse-proxy`, `haproxy`, `nginx`",
		"| `ktls` | kernel TX+RX | 3 (3 SHA ok) | 0.45 | 6.67 % | +0.05 | ×0.321 | ×0.155 | ×0.05 | ×0.02 | 30 | 40 | 32 | 0 B | 0.05 |",
	} {
		requireIn(t, "merged markdown", md, want)
	}
}

// Runs of different setups, or a cell measured in both, do not merge.
func TestMergeRefused(t *testing.T) {
	for name, spoil := range map[string]func(a, b *Results){
		"kernel":       func(a, b *Results) { b.Kernel = "6.1" },
		"mode":         func(a, b *Results) { b.Mode = "native" },
		"parameters":   func(a, b *Results) { b.Params["bulk_bytes"] = []byte("1073741824") },
		"a cell twice": func(a, b *Results) { b.Results = append(b.Results, a.Results[0]) },
		"commit":       func(a, b *Results) { a.Commit, b.Commit = "1111111", "2222222" },
	} {
		a, b := splitFixture(t)
		spoil(a, b)
		if _, err := mergeResults([]*Results{a, b}); err == nil {
			t.Errorf("%s: merged", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
}

func TestChart(t *testing.T) {
	r := loadFixture(t)
	var a, b bytes.Buffer
	if err := renderChart(&a, r); err != nil {
		t.Fatal(err)
	}
	if err := renderChart(&b, loadFixture(t)); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("the same input rendered two different PNGs")
	}
	img, err := png.Decode(bytes.NewReader(a.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	// Title 44 + legend 24 + margin 16; upload: header 26 + 8 rows of 22 +
	// axis 28 + gap 12; download: 26 + 4×22 + 28 + 12.
	if got, want := img.Bounds(), image.Rect(0, 0, 960, 84+242+154); got != want {
		t.Fatalf("chart is %v, want %v", got, want)
	}
	// The ktls bar of the first panel (upload, first row) is drawn in this
	// project's colour just right of the labels.
	x, y := chartMargin+labelW+2, chartTitleH+panelHeaderH+barRowH/2
	if got, want := pixelAt(img, x, y), [4]uint8{colorThis.R, colorThis.G, colorThis.B, colorThis.A}; got != want {
		t.Errorf("pixel (%d,%d) = %v, want the ktls bar %v", x, y, got, colorThis)
	}
}

func pixelAt(img image.Image, x, y int) [4]uint8 {
	r, g, b, a := img.At(x, y).RGBA()
	return [4]uint8{uint8(r >> 8), uint8(g >> 8), uint8(b >> 8), uint8(a >> 8)}
}

func TestHostReport(t *testing.T) {
	data, err := os.ReadFile("testdata/synthetic-host.txt")
	if err != nil {
		t.Fatal(err)
	}
	h, err := parseHostBench(data)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(h.Bench["BenchmarkRelay/splice"].Samples); got != 3 {
		t.Fatalf("%d splice samples, want 3", got)
	}
	md := string(renderHostMarkdown(h))
	for _, want := range []string{
		"- rounds: 3",
		"| `Relay/splice` | 0.8 (0.7–0.9) | 100 | 1000 |",
		// Own CPU per round: splice 0.40, 0.40, 0.30; io.Copy 1.00, 0.80, 1.00.
		"| splice relay's own CPU/GiB ÷ io.CopyBuffer relay's | 0.4 (0.3–0.5) | ≤ 0.5 | **met** |",
		// +5 %, +20 %, 0 %.
		"| handshake + offload setup over a plain crypto/tls handshake (CPU per handshake) | +5 % (0 – +20 %) | ≤ +10 % | **met** |",
		"| preamble verify per frame: ns/op; allocs/op, B/op | 55000 (50000–70000); 0, 0 | < 60 µs; 0, 0 | **met** |",
		// 2000, 3000, 4000 ns per round.
		"| preamble verify above a bare Ed25519 verify (ns per frame) | 3000 (2000–4000) | — | — |",
	} {
		requireIn(t, "host markdown", md, want)
	}

	// A loaded host where Ed25519 alone is over the goal, and a benchmark
	// whose allocations allocs/op rounds down to 0 but B/op shows.
	h, err = parseHostBench([]byte("pkg: example/preamble\n" +
		"BenchmarkVerify-2 10 130000 ns/op 55 B/op 0 allocs/op\n" +
		"BenchmarkEd25519Verify-2 10 128000 ns/op 0 B/op 0 allocs/op\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := "| preamble verify per frame: ns/op; allocs/op, B/op | 130000; 0, 55 | < 60 µs; 0, 0 | " +
		"**missed**: ns/op (a bare Ed25519 verify alone: 128000, same rounds); allocates |"
	requireIn(t, "host markdown", string(renderHostMarkdown(h)), want)
}

func TestBadInput(t *testing.T) {
	if _, err := parseResults([]byte(`{"schema": 2, "results": [{}]}`)); err == nil {
		t.Error("schema 2 accepted")
	}
	if _, err := parseResults([]byte(`{"schema": 1, "results": []}`)); err == nil {
		t.Error("no results accepted")
	}
	if _, err := parseHostBench([]byte("BenchmarkX-2 10 abc ns/op\n")); err == nil {
		t.Error("a malformed benchmark line accepted")
	}
}

// TestRun drives the command as bench.sh and bench-host.sh do.
func TestRun(t *testing.T) {
	dir := t.TempDir()
	md, png := filepath.Join(dir, "results.md"), filepath.Join(dir, "chart.png")
	if err := run([]string{"results", "-in", "testdata/synthetic-results.json", "-md", md, "-png", png}); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{md, png} {
		if st, err := os.Stat(f); err != nil || st.Size() == 0 {
			t.Errorf("%s not written: %v", f, err)
		}
	}
	if err := run([]string{"host", "-in", "testdata/synthetic-host.txt", "-md", filepath.Join(dir, "host.md")}); err != nil {
		t.Fatal(err)
	}
	twice := "testdata/synthetic-results.json,testdata/synthetic-results.json"
	if err := run([]string{"results", "-in", twice, "-md", md}); err == nil || !strings.Contains(err.Error(), "is in run 1 and run 2") {
		t.Errorf("the same run merged with itself: %v", err)
	}
	if err := run([]string{"nonsense", "-in", "x", "-md", "y"}); err == nil {
		t.Error("an unknown report accepted")
	}
}

// The gateway report: both hops summed and apart, the ratios to l7-l7
// beside the published design's, the references marked as one proxy.
func TestGatewayReport(t *testing.T) {
	doc := `{"schema": 1, "mode": "vm-icount", "kernel": "7.3", "params": {"bulk_bytes": 67108864, "repetitions": 3}, "ok": true, "results": [
	{"contender": "l7-l7", "shape": "upload", "cpu_s_per_gib": {"median": 20}, "gib_per_s": {"median": 0.01},
	 "hops": [{"name": "gateway", "cpu_s_per_gib": {"median": 12}}, {"name": "forwarder", "cpu_s_per_gib": {"median": 8}}]},
	{"contender": "l4-l4", "shape": "upload", "cpu_s_per_gib": {"median": 5}, "gib_per_s": {"median": 0.025},
	 "hops": [{"name": "gateway", "cpu_s_per_gib": {"median": 2}}, {"name": "forwarder", "cpu_s_per_gib": {"median": 3}}]},
	{"contender": "ktls", "shape": "upload", "cpu_s_per_gib": {"median": 4}, "gib_per_s": {"median": 0.03}},
	{"contender": "l7-l7", "shape": "small-reuse", "calls_per_cpu_s": {"median": 500}, "cpu_s_per_gib": {"median": 400}},
	{"contender": "l4-l4", "shape": "small-reuse", "calls_per_cpu_s": {"median": 2000}, "cpu_s_per_gib": {"median": 100},
	 "hops": [{"name": "gateway", "calls_per_cpu_s": {"median": 4000}}, {"name": "forwarder", "calls_per_cpu_s": {"median": 4000}}]}
	]}`
	r, err := parseResults([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	md := string(renderGatewayMarkdown(r, []string{"in.json"}, "full.md"))
	for _, want := range []string{
		"| `l4-l4` | — | 5 | 0 % | 2 (40 %) | 3 (60 %) | ×0.25 | 0.025 | ×2.5 |",
		"| `ktls` (one proxy, for reference) |",
		"| throughput | ×3.56 | — | ×2.5 |",
		"| CPU per GB | ×0.155 | — | ×0.25 |",
		"| `l4-l4` | — | 2000 | 0 % | 4000 | 4000 | 0.5 | ×0.25 | — | — |",
		"CPU per small call, ÷ `l7-l7`'s: `small-reuse`: `l4-l4` ×0.25.",
		"[full.md](full.md)",
	} {
		requireIn(t, "gateway report", md, want)
	}
}

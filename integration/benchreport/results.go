package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Results is results.json as integration/bench.sh writes it (schema 1).
// Any figure may be missing or zero for a contender that was not measured
// that way; the report shows "—" for it.
type Results struct {
	Schema       int                        `json:"schema"`
	Mode         string                     `json:"mode"` // vm-icount, vm or native
	Kernel       string                     `json:"kernel"`
	Date         string                     `json:"date"`
	Commit       string                     `json:"commit"` // the checkout measured (git rev-parse HEAD); empty in runs before it was recorded
	Host         string                     `json:"host"`
	Go           string                     `json:"go"`
	Params       map[string]json.RawMessage `json:"params"`
	Notes        []string                   `json:"notes"`
	Results      []Result                   `json:"results"`
	Skipped      []Skipped                  `json:"skipped"`
	TLSStatDelta map[string]float64         `json:"tls_stat_delta"`
	OK           *bool                      `json:"ok"` // every cell moved the exact bytes on the expected data path

	// merged lists the harness runs this document joins (see mergeResults);
	// empty for one run.
	merged []mergedRun
}

// Skipped is a contender the harness could not run, and why.
type Skipped struct {
	Contender string `json:"contender"`
	Reason    string `json:"reason"`
}

// Result is one contender on one shape.
type Result struct {
	Contender    string             `json:"contender"`
	Shape        string             `json:"shape"`
	Runs         []Run              `json:"runs"`
	CPUPerGiB    Summary            `json:"cpu_s_per_gib"`
	GiBPerS      Summary            `json:"gib_per_s"`
	CallsPerCPUS Summary            `json:"calls_per_cpu_s"`
	P50US        float64            `json:"p50_us"`
	P99US        float64            `json:"p99_us"`
	Structural   *Structural        `json:"structural"`
	Offload      string             `json:"offload"`
	TLSStatDelta map[string]float64 `json:"tls_stat_delta"`
	Errors       []string           `json:"errors"`
	// Tunnels and Resumed: the tunnels of the cell and, in the resumed
	// shape, how many of their handshakes resumed a session.
	Tunnels int64 `json:"tunnels"`
	Resumed int64 `json:"resumed"`
	// Hops: an edge-gateway chain's figures per process (CPUPerGiB and
	// CallsPerCPUS above are of all of them); UpstreamConns: the
	// connections the upstream accepted over the cell (a chain's forwarder
	// tunnels).
	Hops          []Hop `json:"hops"`
	UpstreamConns int64 `json:"upstream_conns"`
}

// Hop is one process of a chain over a cell.
type Hop struct {
	Name         string  `json:"name"`
	CPUPerGiB    Summary `json:"cpu_s_per_gib"`
	CallsPerCPUS Summary `json:"calls_per_cpu_s"`
}

// Run is one repetition.
type Run struct {
	CPUS     float64 `json:"cpu_s"`
	UserS    float64 `json:"user_s"`
	SysS     float64 `json:"sys_s"`
	WallS    float64 `json:"wall_s"`
	Bytes    int64   `json:"bytes"`
	Calls    int64   `json:"calls"`
	P50US    float64 `json:"p50_us"`
	P99US    float64 `json:"p99_us"`
	SHA256OK *bool   `json:"sha256_ok"`
	Error    string  `json:"error"`
}

// Summary is a figure over the repetitions.
type Summary struct {
	Min       float64 `json:"min"`
	Median    float64 `json:"median"`
	Max       float64 `json:"max"`
	SpreadPct float64 `json:"spread_pct"`
}

// Structural holds the exact counts of one traced transfer and, where the
// harness could count them in the kernel, the syscalls of an untraced
// transfer of the same size.
type Structural struct {
	Bytes                int64          `json:"bytes"`
	SyscallsPerGiB       float64        `json:"syscalls_per_gib"`
	DataSyscallsPerGiB   float64        `json:"data_syscalls_per_gib"` // the calls that move payload
	UserspaceBytesPerGiB float64        `json:"userspace_bytes_per_gib"`
	SyscallsPerCall      float64        `json:"syscalls_per_call"`
	Top                  []SyscallCount `json:"top_syscalls"`
	Source               string         `json:"source"`

	UntracedSyscallsPerGiB  float64 `json:"untraced_syscalls_per_gib"`
	UntracedSyscallsPerCall float64 `json:"untraced_syscalls_per_call"`
	UntracedSource          string  `json:"untraced_source"`
	UntracedError           string  `json:"untraced_error"`
}

// goalSyscallsPerGiB is the figure the syscall goal compares: the untraced
// count where both sides have one (strace's stops stretch the runtime's
// time-driven calls), else the traced count; untraced says which.
func goalSyscallsPerGiB(a, b *Structural) (x, y float64, untraced bool) {
	if a.UntracedSyscallsPerGiB > 0 && b.UntracedSyscallsPerGiB > 0 {
		return a.UntracedSyscallsPerGiB, b.UntracedSyscallsPerGiB, true
	}
	return a.SyscallsPerGiB, b.SyscallsPerGiB, false
}

// SyscallCount is one system call's count in the traced transfer.
type SyscallCount struct {
	Name  string `json:"name"`
	Count int64  `json:"count"`
}

func parseResults(data []byte) (*Results, error) {
	var r Results
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, err
	}
	if r.Schema != 1 {
		return nil, fmt.Errorf("schema %d, this renderer reads schema 1", r.Schema)
	}
	if len(r.Results) == 0 {
		return nil, errors.New("no results")
	}
	return &r, nil
}

// The contenders and shapes in report order, with what each one is.
// Names not listed here follow in alphabetical order.
var (
	contenders = []struct{ name, what string }{
		{"ktls", "this project: kTLS TX+RX in the kernel, splice(2) both ways"},
		{"ktls-rx-off", "this project with `rx off`: kernel seals, Go opens records, upstream direction copies"},
		{"ktls-off", "this project with `offload off`: userspace TLS (Go crypto/tls), copy relay"},
		{"l4-proxy", "caddy-l4 `tls` + `proxy` handlers: userspace TLS, L4 copy"},
		{"reverse-proxy", "Caddy `reverse_proxy` (L7): userspace TLS, HTTP parsed and re-sent"},
		{"haproxy", "HAProxy (Debian's), TLS termination in userspace (OpenSSL), TCP mode"},
		{"nginx", "nginx (Debian's) stream module, TLS termination in userspace (OpenSSL)"},
		{"floor-ktls", "the crypto floor: kTLS RX/TX + splice, nothing else"},
		{"floor-plain", "plaintext splice, no crypto at all"},
		{"floor-rw-ktls", "independent floor (no project code): kTLS RX/TX + read/write copy relay"},
		{"floor-rw-plain", "plaintext read/write copy relay, no crypto, no splice"},
	}
	shapes = []struct{ name, what string }{
		{"upload", "bulk transfer, client → sandbox"},
		{"download", "bulk transfer, sandbox → client"},
		{"small-reuse", "small request/response calls on reused connections"},
		{"small-per-call", "small request/response calls, a new connection (and TLS handshake) per call"},
		{"small-per-call-resumed", "small request/response calls, a new connection per call whose TLS handshake resumes a session (the gateway keeps a session cache)"},
	}
	// userspacePeers are the peers the small-call goals compare with.
	userspacePeers = []string{"l4-proxy", "reverse-proxy", "haproxy", "nginx"}
)

const (
	floorContender = "floor-ktls"
	l4Contender    = "l4-proxy"
	rpContender    = "reverse-proxy"
	fastContender  = "ktls"
)

func isBulk(shape string) bool { return shape == "upload" || shape == "download" }

// orderOf sorts names by the listed order, unknown names last and alphabetically.
func orderOf[T any](names []string, known []T, name func(T) string) []string {
	rank := map[string]int{}
	for i, k := range known {
		rank[name(k)] = i
	}
	out := slices.Clone(names)
	sort.SliceStable(out, func(i, j int) bool {
		ri, iok := rank[out[i]]
		rj, jok := rank[out[j]]
		switch {
		case iok && jok:
			return ri < rj
		case iok != jok:
			return iok
		default:
			return out[i] < out[j]
		}
	})
	return out
}

// shapeTable is the results of one shape, in contender order.
type shapeTable struct {
	shape string
	rows  []*Result
	by    map[string]*Result
}

func (r *Results) tables() []shapeTable {
	byShape := map[string]*shapeTable{}
	var shapeNames []string
	for i := range r.Results {
		res := &r.Results[i]
		st := byShape[res.Shape]
		if st == nil {
			st = &shapeTable{shape: res.Shape, by: map[string]*Result{}}
			byShape[res.Shape] = st
			shapeNames = append(shapeNames, res.Shape)
		}
		if _, dup := st.by[res.Contender]; !dup {
			st.by[res.Contender] = res
		}
	}
	var out []shapeTable
	for _, s := range orderOf(shapeNames, shapes, func(s struct{ name, what string }) string { return s.name }) {
		st := byShape[s]
		var names []string
		for n := range st.by {
			names = append(names, n)
		}
		for _, n := range orderOf(names, contenders, func(c struct{ name, what string }) string { return c.name }) {
			st.rows = append(st.rows, st.by[n])
		}
		out = append(out, *st)
	}
	return out
}

// cpu is the CPU seconds per GiB over the repetitions: the summary the
// harness wrote, or, when it wrote none, one computed from the runs.
func (res *Result) cpu() Summary {
	if res == nil {
		return Summary{}
	}
	if res.CPUPerGiB.Median > 0 {
		return res.CPUPerGiB
	}
	var v []float64
	for _, run := range res.Runs {
		if run.CPUS > 0 && run.Bytes > 0 {
			v = append(v, run.CPUS/(float64(run.Bytes)/(1<<30)))
		}
	}
	return summarize(v)
}

func summarize(v []float64) Summary {
	if len(v) == 0 {
		return Summary{}
	}
	v = slices.Clone(v)
	slices.Sort(v)
	med := v[len(v)/2]
	if len(v)%2 == 0 {
		med = (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	s := Summary{Min: v[0], Median: med, Max: v[len(v)-1]}
	if med != 0 {
		s.SpreadPct = (s.Max - s.Min) / med * 100
	}
	return s
}

// spread is the summary's spread in percent of its median.
func (s Summary) spread() (float64, bool) {
	if s.Median == 0 {
		return 0, false
	}
	if s.SpreadPct != 0 || s.Max == s.Min {
		return s.SpreadPct, true
	}
	return (s.Max - s.Min) / s.Median * 100, true
}

// aboveFloor is a contender's CPU-s/GiB above the crypto floor's in the
// same shape: what it adds on top of the unavoidable record crypto.
func (st shapeTable) aboveFloor(res *Result) (float64, bool) {
	c, f := res.cpu().Median, st.by[floorContender].cpu().Median
	if c == 0 || f == 0 {
		return 0, false
	}
	return c - f, true
}

// ratio divides two figures that must both be measured (non-zero).
func ratio(a float64, aok bool, b float64, bok bool) (float64, bool) {
	if !aok || !bok || b == 0 {
		return 0, false
	}
	return a / b, true
}

func (st shapeTable) cpuRatio(res *Result, to string) (float64, bool) {
	c, d := res.cpu().Median, st.by[to].cpu().Median
	return ratio(c, c > 0, d, d > 0)
}

// aboveFloorRatio compares two contenders' CPU above the crypto floor. The
// floors themselves have no such ratio: they are the reference.
func (st shapeTable) aboveFloorRatio(res *Result, to string) (float64, bool) {
	other := st.by[to]
	if other == nil || strings.HasPrefix(res.Contender, "floor-") {
		return 0, false
	}
	a, aok := st.aboveFloor(res)
	b, bok := st.aboveFloor(other)
	if bok && b <= 0 {
		return 0, false // the reference is not above the floor: no meaningful ratio
	}
	return ratio(a, aok, b, bok)
}

func (st shapeTable) callsRatio(res *Result, to string) (float64, bool) {
	other := st.by[to]
	if other == nil {
		return 0, false
	}
	a, b := res.CallsPerCPUS.Median, other.CallsPerCPUS.Median
	return ratio(a, a > 0, b, b > 0)
}

// --- formatting -----------------------------------------------------------

const dash = "—"

// num formats a figure with three significant digits (whole numbers from
// 1000 up), without trailing zeros or exponents.
func num(v float64) string {
	if math.Abs(v) >= 1000 {
		return strconv.FormatFloat(math.Round(v), 'f', 0, 64)
	}
	r, _ := strconv.ParseFloat(strconv.FormatFloat(v, 'g', 3, 64), 64)
	if r == 0 {
		return "0"
	}
	return strconv.FormatFloat(r, 'f', -1, 64)
}

func opt(v float64, ok bool, f func(float64) string) string {
	if !ok {
		return dash
	}
	return f(v)
}

func pct(v float64) string { return num(v) + " %" }

func times(v float64) string { return "×" + num(v) }

// overheadTimes formats a ratio of two overheads above the crypto floor. A
// contender measured under the floor's median (within the spreads) has no
// overhead to compare: its ratio is negative and shown as ≤ 0.
func overheadTimes(v float64) string {
	if v < 0 {
		return "≤ 0 (under the floor's median)"
	}
	return times(v)
}

func signed(v float64) string {
	if v > 0 {
		return "+" + num(v)
	}
	return num(v)
}

// bytesIEC formats a byte count with a binary unit.
func bytesIEC(v float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	for math.Abs(v) >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	if i == 0 {
		return strconv.FormatFloat(v, 'f', 0, 64) + " B"
	}
	return num(v) + " " + units[i]
}

// runsOK says how many repetitions there were and how many moved exactly
// the expected bytes (SHA-256 compared).
func runsOK(res *Result) string {
	if len(res.Runs) == 0 {
		return dash
	}
	ok, known := 0, 0
	for _, r := range res.Runs {
		if r.SHA256OK != nil {
			known++
			if *r.SHA256OK {
				ok++
			}
		}
	}
	if known == 0 {
		return strconv.Itoa(len(res.Runs))
	}
	s := fmt.Sprintf("%d (%d SHA ok)", len(res.Runs), ok)
	if ok < len(res.Runs) {
		s += " **SHA MISMATCH**"
	}
	for _, r := range res.Runs {
		if r.Error != "" {
			return s + " **run error**"
		}
	}
	return s
}

func offload(res *Result) string {
	if res.Offload == "" {
		return dash
	}
	return res.Offload
}

func mdRow(b *bytes.Buffer, cells ...string) {
	b.WriteString("| ")
	for i, c := range cells {
		if i > 0 {
			b.WriteString(" | ")
		}
		b.WriteString(strings.ReplaceAll(c, "|", `\|`))
	}
	b.WriteString(" |\n")
}

func mdHeader(b *bytes.Buffer, cells ...string) {
	mdRow(b, cells...)
	sep := make([]string, len(cells))
	for i := range sep {
		sep[i] = "---"
	}
	mdRow(b, sep...)
}

// --- the report -----------------------------------------------------------

var modeText = map[string]string{
	"vm-icount": "qemu TCG with `-icount shift=0`: guest time counts instructions (1 ns each), so CPU seconds are instruction counts, repeatable to about 3 % and comparable between contenders of this run; wall-clock throughput is not a speed.",
	"vm":        "qemu TCG without icount: guest CPU and wall-clock times are emulation times (AES about 250× slower than native); only ratios between contenders of the same run mean anything.",
	"native":    "a native kernel with kTLS: CPU seconds and throughput are real, for this machine.",
}

// writeTitle writes a report's title and the sentence that says which
// renderer made it from which sources, up to "do not edit by hand.".
func writeTitle(b *bytes.Buffer, title, renderer string, sources []string) {
	quoted := make([]string, len(sources))
	for i, s := range sources {
		quoted[i] = "`" + s + "`"
	}
	fmt.Fprintf(b, "# %s\n\n", title)
	fmt.Fprintf(b, "Rendered by `%s` from %s (written by `integration/bench.sh`); do not edit by hand.", renderer, strings.Join(quoted, " and "))
}

// renderResultsMarkdown writes the report of r, read from the files named
// in sources, with a link to chart when it is not empty.
func renderResultsMarkdown(r *Results, sources []string, chart string) []byte {
	var b bytes.Buffer
	tables := r.tables()
	writeTitle(&b, "Benchmarks: caddy-ktls against its peers", "integration/benchreport", sources)
	if chart != "" {
		fmt.Fprintf(&b, " Chart: [%s](%s).", chart, chart)
	}
	b.WriteString("\n\n")

	b.WriteString("## What was run\n\n")
	mode := r.Mode
	if t, ok := modeText[mode]; ok {
		mode += ": " + t
	}
	for _, kv := range [][2]string{{"Mode", mode}, {"Kernel", r.Kernel}, {"Date", r.Date}, {"Host", r.Host}, {"Go", r.Go}} {
		v := kv[1]
		if v == "" {
			v = dash
		}
		fmt.Fprintf(&b, "- %s: %s\n", kv[0], v)
	}
	if r.Commit != "" {
		fmt.Fprintf(&b, "- Commit: %s\n", r.Commit)
	}
	if len(r.merged) > 0 {
		fmt.Fprintf(&b, "\nThe cells come from %d runs of the harness with the same kernel, binaries and parameters, one after another or side by side on the host:\n\n", len(r.merged))
		for i, m := range r.merged {
			fmt.Fprintf(&b, "%d. %s: `%s`\n", i+1, m.date, strings.Join(m.contenders, "`, `"))
		}
		b.WriteString("\nA ratio between cells of different runs compares like with like only where the CPU figure does not depend on the host: under icount (guest CPU counts the forwarder's instructions), not in wall-clock modes.\n")
	}
	if len(r.Params) > 0 {
		b.WriteString("\n")
		mdHeader(&b, "parameter", "value")
		keys := make([]string, 0, len(r.Params))
		for k := range r.Params {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			var c bytes.Buffer
			if json.Compact(&c, r.Params[k]) != nil {
				c.Reset()
				c.Write(r.Params[k])
			}
			v := c.String()
			if n, err := strconv.ParseFloat(v, 64); err == nil && strings.HasSuffix(k, "bytes") && n >= 1024 {
				v += " (" + bytesIEC(n) + ")"
			}
			mdRow(&b, "`"+k+"`", v)
		}
	}
	if len(r.Notes) > 0 {
		b.WriteString("\nNotes from the harness:\n\n")
		for _, n := range r.Notes {
			fmt.Fprintf(&b, "- %s\n", n)
		}
	}
	if len(r.TLSStatDelta) > 0 {
		fmt.Fprintf(&b, "\n`/proc/net/tls_stat` moved over the whole run by: %s.\n", statText(r.TLSStatDelta))
	}
	if r.OK != nil {
		if *r.OK {
			b.WriteString("\nThe harness checked every cell: exact bytes (SHA-256) on the expected data path.\n")
		} else {
			b.WriteString("\n**The harness reported failures**: see the errors under the tables.\n")
		}
	}
	if len(r.Skipped) > 0 {
		b.WriteString("\nNot run:\n\n")
		for _, sk := range r.Skipped {
			fmt.Fprintf(&b, "- `%s`: %s\n", sk.Contender, sk.Reason)
		}
	}

	b.WriteString("\n### Contenders\n\n")
	mdHeader(&b, "contender", "what it is")
	seen := map[string]bool{}
	for _, st := range tables {
		for _, res := range st.rows {
			seen[res.Contender] = true
		}
	}
	var all []string
	for c := range seen {
		all = append(all, c)
	}
	what := map[string]string{}
	for _, c := range contenders {
		what[c.name] = c.what
	}
	for _, c := range orderOf(all, contenders, func(c struct{ name, what string }) string { return c.name }) {
		w := what[c]
		if w == "" {
			w = dash
		}
		mdRow(&b, "`"+c+"`", w)
	}

	shapeWhat := map[string]string{}
	for _, s := range shapes {
		shapeWhat[s.name] = s.what
	}
	for _, st := range tables {
		fmt.Fprintf(&b, "\n## Shape `%s`", st.shape)
		if w := shapeWhat[st.shape]; w != "" {
			fmt.Fprintf(&b, ": %s", w)
		}
		b.WriteString("\n\n")
		if isBulk(st.shape) || !st.hasCalls() {
			st.bulkTable(&b)
		} else {
			st.smallTable(&b)
		}
		st.details(&b)
	}

	b.WriteString("\n## Goals\n\n")
	mdHeader(&b, "goal", "measured", "status")
	for _, g := range goals(tables) {
		mdRow(&b, g.goal, g.measured, g.status)
	}

	b.WriteString("\n## What this measures and what it cannot\n\n")
	b.WriteString(limitsText)
	return b.Bytes()
}

func (st shapeTable) hasCalls() bool {
	for _, res := range st.rows {
		if res.CallsPerCPUS.Median > 0 {
			return true
		}
	}
	return false
}

func (st shapeTable) bulkTable(b *bytes.Buffer) {
	mdHeader(b, "contender", "offload", "runs", "CPU-s/GiB (median)", "spread", "above floor-ktls",
		"÷ l4-proxy", "÷ reverse-proxy", "above floor ÷ l4-proxy's", "above floor ÷ reverse-proxy's",
		"syscalls/GiB (untraced)", "syscalls/GiB (strace)", "data syscalls/GiB (strace)", "userspace bytes/GiB", "GiB/s (informational)")
	for _, res := range st.rows {
		cpu := res.cpu()
		sp, spok := cpu.spread()
		above, aok := st.aboveFloor(res)
		rl4, rl4ok := st.cpuRatio(res, l4Contender)
		rrp, rrpok := st.cpuRatio(res, rpContender)
		al4, al4ok := st.aboveFloorRatio(res, l4Contender)
		arp, arpok := st.aboveFloorRatio(res, rpContender)
		untraced, sys, data, ub := dash, dash, dash, dash
		if s := res.Structural; s != nil {
			untraced = opt(s.UntracedSyscallsPerGiB, s.UntracedSyscallsPerGiB > 0, num)
			sys, ub = num(s.SyscallsPerGiB), bytesIEC(s.UserspaceBytesPerGiB)
			data = opt(s.DataSyscallsPerGiB, s.DataSyscallsPerGiB > 0, num)
		}
		mdRow(b, "`"+res.Contender+"`", offload(res), runsOK(res),
			opt(cpu.Median, cpu.Median > 0, num), opt(sp, spok, pct), opt(above, aok, signed),
			opt(rl4, rl4ok, times), opt(rrp, rrpok, times), opt(al4, al4ok, overheadTimes), opt(arp, arpok, overheadTimes),
			untraced, sys, data, ub, opt(res.GiBPerS.Median, res.GiBPerS.Median > 0, num))
	}
}

func (st shapeTable) smallTable(b *bytes.Buffer) {
	mdHeader(b, "contender", "offload", "runs", "calls/CPU-s (median)", "spread", "÷ l4-proxy", "÷ reverse-proxy",
		"p50 µs", "p99 µs", "syscalls/call (untraced)", "syscalls/call (strace)", "CPU-s/GiB (median)", "above floor-ktls", "handshakes resumed")
	for _, res := range st.rows {
		calls := res.CallsPerCPUS
		sp, spok := calls.spread()
		rl4, rl4ok := st.callsRatio(res, l4Contender)
		rrp, rrpok := st.callsRatio(res, rpContender)
		cpu := res.cpu()
		above, aok := st.aboveFloor(res)
		untraced, perCall := dash, dash
		if s := res.Structural; s != nil {
			untraced = opt(s.UntracedSyscallsPerCall, s.UntracedSyscallsPerCall > 0, num)
			perCall = opt(s.SyscallsPerCall, s.SyscallsPerCall > 0, num)
		}
		mdRow(b, "`"+res.Contender+"`", offload(res), runsOK(res),
			opt(calls.Median, calls.Median > 0, num), opt(sp, spok, pct), opt(rl4, rl4ok, times), opt(rrp, rrpok, times),
			opt(res.P50US, res.P50US > 0, num), opt(res.P99US, res.P99US > 0, num), untraced, perCall,
			opt(cpu.Median, cpu.Median > 0, num), opt(above, aok, signed), resumed(st.shape, res))
	}
}

// resumed says how many of a resumed-shape cell's handshakes resumed.
func resumed(shape string, res *Result) string {
	if shape != "small-per-call-resumed" || res.Tunnels == 0 {
		return dash
	}
	return fmt.Sprintf("%d of %d", res.Resumed, res.Tunnels)
}

// details lists, under a shape's table, the traced transfers' most frequent
// system calls and any error the harness recorded.
func (st shapeTable) details(b *bytes.Buffer) {
	var top, errs, sources, untraced, uncounted []string
	for _, res := range st.rows {
		s := res.Structural
		if s == nil {
			continue
		}
		if s.Source != "" && !slices.Contains(sources, s.Source) {
			sources = append(sources, s.Source)
		}
		switch {
		case s.UntracedError != "":
			uncounted = append(uncounted, fmt.Sprintf("- `%s`: %s", res.Contender, s.UntracedError))
		case s.UntracedSource != "" && !slices.Contains(untraced, s.UntracedSource):
			untraced = append(untraced, s.UntracedSource)
		}
	}
	for _, res := range st.rows {
		if s := res.Structural; s != nil && len(s.Top) > 0 {
			parts := make([]string, len(s.Top))
			for i, c := range s.Top {
				parts[i] = fmt.Sprintf("%s %d", c.Name, c.Count)
			}
			src := ""
			if len(sources) > 1 && s.Source != "" {
				src = " (" + s.Source + ")"
			}
			top = append(top, fmt.Sprintf("- `%s`, %s traced%s: %s", res.Contender, bytesIEC(float64(s.Bytes)), src, strings.Join(parts, ", ")))
		}
		for _, e := range res.Errors {
			errs = append(errs, fmt.Sprintf("- `%s`: %s", res.Contender, e))
		}
	}
	if len(top) > 0 {
		b.WriteString("\nMost frequent system calls of the forwarder in the traced transfer")
		if len(sources) == 1 {
			b.WriteString(" (" + sources[0] + ")")
		}
		b.WriteString(":\n\n")
		b.WriteString(strings.Join(top, "\n") + "\n")
	}
	if len(untraced) > 0 {
		b.WriteString("\nUntraced syscall counts: a second transfer of the traced size, counted by " + strings.Join(untraced, "; ") + ".\n")
	}
	if len(uncounted) > 0 {
		b.WriteString("\nNo untraced syscall count:\n\n" + strings.Join(uncounted, "\n") + "\n")
	}
	if len(errs) > 0 {
		b.WriteString("\n**Errors recorded by the harness:**\n\n")
		b.WriteString(strings.Join(errs, "\n") + "\n")
	}
}

func statText(m map[string]float64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("`%s` %s", k, strconv.FormatFloat(m[k], 'f', -1, 64))
	}
	return strings.Join(parts, ", ")
}

type goalRow struct{ goal, measured, status string }

// payloadThreshold separates a spliced data path from a copied one in
// userspace bytes per GiB beyond the crypto floor's (see goals): a copied
// direction adds 1 GiB per GiB (2 with a read and a write counted), a
// preamble per connection adds well under a twentieth of that even for a
// traced transfer of a few KiB.
const payloadThreshold = (1 << 30) / 20

const (
	met         = "**met**"
	missed      = "**missed**"
	notMeasured = "not measured"
)

func verdict(ok bool) string {
	if ok {
		return met
	}
	return missed
}

// goals evaluates the goals that results.json can answer: issue 7's per
// bulk shape, issue 18's per small shape; the host and idle-tunnel goals
// point to their own reports.
func goals(tables []shapeTable) []goalRow {
	var out []goalRow
	for _, st := range tables {
		if !isBulk(st.shape) {
			out = append(out, smallGoals(st)...)
			continue
		}
		k, l4 := st.by[fastContender], st.by[l4Contender]
		sh := " (" + st.shape + ")"

		// Both ktls and the floor run the TLS handshake in Go, so their
		// userspace bytes include it; what ktls adds beyond the floor is the
		// preamble, a few hundred bytes per connection. A payload direction
		// through userspace would add at least 1 GiB per GiB, so a difference
		// under payloadThreshold means no payload byte went through userspace.
		g := goalRow{goal: "fast path: 0 payload bytes through userspace per GiB" + sh, status: notMeasured, measured: dash}
		if f := st.by[floorContender]; k != nil && k.Structural != nil && f != nil && f.Structural != nil {
			diff := k.Structural.UserspaceBytesPerGiB - f.Structural.UserspaceBytesPerGiB
			g.measured = fmt.Sprintf("ktls %s/GiB − floor-ktls %s/GiB (handshakes) = %s/GiB (preambles)",
				bytesIEC(k.Structural.UserspaceBytesPerGiB), bytesIEC(f.Structural.UserspaceBytesPerGiB), bytesIEC(diff))
			if l4 != nil && l4.Structural != nil {
				g.measured += "; l4-proxy " + bytesIEC(l4.Structural.UserspaceBytesPerGiB) + "/GiB"
			}
			g.status = verdict(diff < payloadThreshold)
		}
		out = append(out, g)

		// The goal counts every syscall, untraced where both were counted
		// so. The payload-moving ones are shown beside it: the others (the
		// Go runtime's timers, futexes and netpoller) grow with the
		// transfer's duration, not its bytes.
		g = goalRow{goal: "syscalls/GiB ≤ 0.1 × l4-proxy's" + sh, status: notMeasured, measured: dash}
		if k != nil && l4 != nil && k.Structural != nil && l4.Structural != nil && l4.Structural.SyscallsPerGiB > 0 {
			ks, ls := k.Structural, l4.Structural
			x, y, untraced := goalSyscallsPerGiB(ks, ls)
			r := x / y
			g.measured = fmt.Sprintf("%s vs %s: %s", num(x), num(y), times(r))
			if untraced {
				g.measured = fmt.Sprintf("untraced %s; under strace %s vs %s: %s", g.measured,
					num(ks.SyscallsPerGiB), num(ls.SyscallsPerGiB), times(ks.SyscallsPerGiB/ls.SyscallsPerGiB))
			}
			if ks.DataSyscallsPerGiB > 0 && ls.DataSyscallsPerGiB > 0 {
				g.measured += fmt.Sprintf("; data syscalls alone %s vs %s: %s", num(ks.DataSyscallsPerGiB), num(ls.DataSyscallsPerGiB), times(ks.DataSyscallsPerGiB/ls.DataSyscallsPerGiB))
			}
			g.status = verdict(r <= 0.1)
		}
		out = append(out, g)

		for _, ref := range []struct {
			name  string
			limit float64
		}{{l4Contender, 0.1}, {rpContender, 0.05}} {
			g = goalRow{goal: fmt.Sprintf("CPU above the crypto floor ≤ %s × %s's%s", num(ref.limit), ref.name, sh), status: notMeasured, measured: dash}
			if other := st.by[ref.name]; k != nil && other != nil {
				a, aok := st.aboveFloor(k)
				b, bok := st.aboveFloor(other)
				if r, ok := st.aboveFloorRatio(k, ref.name); ok {
					g.measured = fmt.Sprintf("%s vs %s CPU-s/GiB: %s", signed(a), signed(b), overheadTimes(r))
					g.status = verdict(r <= ref.limit)
				} else if aok && bok {
					g.measured = fmt.Sprintf("%s vs %s CPU-s/GiB", signed(a), signed(b))
				}
			}
			out = append(out, g)
		}
	}
	out = append(out,
		goalRow{"host plaintext: splice relay CPU/GiB ≤ 0.5 × io.Copy relay's", "native Go benchmarks: [host.md](host.md)", "see host.md"},
		goalRow{"offload setup ≤ 10 % over a plain handshake", "native Go benchmarks: [host.md](host.md)", "see host.md"},
		goalRow{"idle tunnel ≤ 16 KiB heap, no pipe held", "[idle.md](idle.md)", "see idle.md"},
	)
	return out
}

// smallGoals evaluates issue 18's goals for a small-call shape: on reused
// connections, calls per CPU-second ≥ 1.2 × the best userspace peer's and
// p99 ≤ the best peer's; with a connection per call, ≥ 1.0 × l4-proxy's and
// ≥ 1.2 × reverse-proxy's calls per CPU-second.
func smallGoals(st shapeTable) []goalRow {
	sh := " (" + st.shape + ")"
	k := st.by[fastContender]
	calls := func(r *Result) (float64, bool) {
		if r == nil || r.CallsPerCPUS.Median <= 0 {
			return 0, false
		}
		return r.CallsPerCPUS.Median, true
	}
	kc, kok := calls(k)
	callsGoal := func(goal string, ref string, refCalls float64, limit float64) goalRow {
		g := goalRow{goal: goal + sh, status: notMeasured, measured: dash}
		if kok && refCalls > 0 {
			r := kc / refCalls
			g.measured = fmt.Sprintf("ktls %s vs %s %s calls/CPU-s: %s", num(kc), ref, num(refCalls), times(r))
			g.status = verdict(r >= limit)
		}
		return g
	}
	if st.shape != "small-reuse" {
		var out []goalRow
		for _, ref := range []struct {
			name  string
			limit float64
		}{{l4Contender, 1.0}, {rpContender, 1.2}} {
			c, _ := calls(st.by[ref.name])
			out = append(out, callsGoal(fmt.Sprintf("calls/CPU-s ≥ %s × %s's", num(ref.limit), ref.name), ref.name, c, ref.limit))
		}
		return out
	}
	bestCalls, bestCallsName := 0.0, ""
	bestP99, bestP99Name := 0.0, ""
	for _, name := range userspacePeers {
		r := st.by[name]
		if c, ok := calls(r); ok && c > bestCalls {
			bestCalls, bestCallsName = c, name
		}
		if r != nil && r.P99US > 0 && (bestP99Name == "" || r.P99US < bestP99) {
			bestP99, bestP99Name = r.P99US, name
		}
	}
	out := []goalRow{callsGoal("calls/CPU-s ≥ 1.2 × the best userspace peer's", "best peer "+bestCallsName, bestCalls, 1.2)}
	g := goalRow{goal: "p99 ≤ the best userspace peer's" + sh, status: notMeasured, measured: dash}
	if k != nil && k.P99US > 0 && bestP99Name != "" {
		g.measured = fmt.Sprintf("ktls %s µs vs best peer %s %s µs: %s", num(k.P99US), bestP99Name, num(bestP99), times(k.P99US/bestP99))
		g.status = verdict(k.P99US <= bestP99)
	}
	return append(out, g)
}

const limitsText = `- **Structural figures are exact counts** of one traced transfer (the
  ` + "`source`" + ` the harness names): system calls per GiB moved, the data
  syscalls among them (those that move payload: socket reads and writes,
  splice, sendfile) and bytes that went through userspace buffers per GiB.
  Userspace bytes do not depend on the machine or its load; data syscalls
  barely do (a splice or read that finds nothing ready, EAGAIN, counts too).
  The other syscalls (the Go runtime's nanosleep, futex, epoll_pwait) grow
  with the transfer's duration, which the VM stretches a few hundred-fold,
  and strace's stops stretch it further. So a second transfer of the same
  size is counted untraced, in the kernel (a tracepoint counter per
  forwarder thread): the syscall goal uses that count where it exists.
- **CPU-s/GiB is the forwarder's CPU** (user + system) per GiB, median over
  the repetitions, with the spread (max − min in % of the median). Under
  icount it counts guest instructions at 1 ns each: repeatable and
  comparable between contenders of one run, but blind to memory bandwidth,
  caches, branch prediction and NIC offload, so it is a cost model, not
  native seconds.
- **Above floor-ktls** subtracts the crypto floor (kTLS + splice and
  nothing else) measured in the same run: what a contender adds on top of the
  record crypto that every TLS terminator pays. The goals compare these
  overheads, because the crypto itself is the same work for all.
- **Throughput** in the VM is informational only: TCG emulates AES about 250×
  slower than AES-NI, so GiB/s says nothing about native speed.
- **It cannot show** native throughput, NIC TLS offload (` + "`TLS_HW`" + `),
  scaling over cores, or latency on a real network. Native wall-clock figures
  for the plaintext relay and the handshake are in [host.md](host.md);
  memory per idle tunnel is in [idle.md](idle.md).
`

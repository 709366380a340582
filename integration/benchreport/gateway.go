package main

import (
	"bytes"
	"fmt"
	"strings"
)

// The edge-gateway report (issue 19): the three paths from the user to the
// sandbox, CPU of every hop summed and per hop, their ratios to the old
// path (l7-l7) beside the published design's, and what the cost model can
// say about them.

// gatewayPaths are the chains in report order, what each hop does, and the
// kernel TLS sockets of a forwarder tunnel.
var gatewayPaths = []struct{ name, user, gw, back, keys string }{
	{"l7-l7", "TLS 1.3, HTTP/1.1 (Caddy `reverse_proxy`, userspace TLS)",
		"mutual TLS, HTTP/1.1, pooled (Caddy `reverse_proxy` to a dataplane Caddy `reverse_proxy`)",
		"HTTP/1.1, plain TCP", "none"},
	{"l7-l4", "TLS 1.3, HTTP/1.1 (Caddy `reverse_proxy`, userspace TLS)",
		"mutual TLS + preamble, kTLS both ends, HTTP/1.1, pooled (`transport sandbox` to this project's forwarder)",
		"the forwarder splices the tunnel to the app", "2 (gateway's forwarder socket, forwarder's)"},
	{"l4-l4", "TLS 1.3, terminated in the kernel (`ktls` handler)",
		"mutual TLS + preamble, kTLS, one tunnel per user connection (`sandbox_proxy`), splice kTLS → kTLS",
		"the forwarder splices the tunnel to the upstream (raw TCP)", "3 (gateway's user socket, its forwarder socket, forwarder's)"},
}

// gatewayShapes say what the small shapes are from the user's side.
var gatewayShapes = map[string]string{
	"small-reuse":            "calls on the user's reused connections (the L7 gateways reuse their pooled tunnels; l4-l4 has one tunnel per user connection)",
	"small-per-call":         "a new user connection (full TLS handshake) per call; l4-l4 opens a new tunnel for each",
	"small-per-call-resumed": "the same, the user's client resuming its TLS session (session cache)",
}

// gatewayRefs are the single-process contenders of the same run shown for
// reference: one proxy in front of the app, no second hop.
var gatewayRefs = []string{"ktls", "reverse-proxy"}

const (
	oldPath = "l7-l7"
	// The published design's figures for its move from L7 to L4.
	publishedThroughput = 3.56
	publishedCPU        = 0.155
)

func renderGatewayMarkdown(r *Results, sources []string, full string) []byte {
	var b bytes.Buffer
	tables := r.tables()
	writeTitle(&b, "The edge gateway's paths: L7 and L4, user to sandbox", "integration/benchreport gateway", sources)
	if full != "" {
		fmt.Fprintf(&b, " Every figure of the same run (syscalls, userspace bytes, key installs, errors): [%s](%s).", full, full)
	}
	b.WriteString("\n\n")
	b.WriteString(`Issue 19's comparison, reproduced in one run: the bench's client plays the
user (a plain TLS 1.3 client: no client certificate, no preamble) and each
path is two Caddy processes, the **gateway** (what the user dials) and the
hop behind it, the **forwarder** on the sandbox's host (for ` + "`l7-l7`" + `, a
dataplane Caddy ` + "`reverse_proxy`" + `), in front of the same app: the harness's
upstream, whose CPU is not counted (it serves HTTP/1.1 for the L7 paths and
its raw protocol for ` + "`l4-l4`" + `). The gateway reaches the forwarder over mutual
TLS with its client certificate; on the sandbox paths it signs a preamble per
tunnel, which the forwarder verifies.

`)
	mdHeader(&b, "path", "user → gateway", "gateway → forwarder", "forwarder → app", "kernel TLS sockets per forwarder tunnel")
	for _, p := range gatewayPaths {
		mdRow(&b, "`"+p.name+"`", p.user, p.gw, p.back, p.keys)
	}

	b.WriteString("\n## What was run\n\n")
	mode := r.Mode
	if t, ok := modeText[mode]; ok {
		mode += ": " + t
	}
	for _, kv := range [][2]string{{"Mode", mode}, {"Kernel", r.Kernel}, {"Date", r.Date}, {"Go", r.Go}} {
		v := kv[1]
		if v == "" {
			v = dash
		}
		fmt.Fprintf(&b, "- %s: %s\n", kv[0], v)
	}
	if r.Commit != "" {
		fmt.Fprintf(&b, "- Commit: %s\n", r.Commit)
	}
	params := paramText(r)
	if params != "" {
		fmt.Fprintf(&b, "- Sizes: %s\n", params)
	}
	if len(r.merged) > 0 {
		for i, m := range r.merged {
			fmt.Fprintf(&b, "- VM %d (%s): `%s`\n", i+1, m.date, strings.Join(m.contenders, "`, `"))
		}
		b.WriteString("\nThe three paths share one VM, so their ratios come from one run; the references ran beside them in a second VM of the same setup (under icount a guest's figures do not depend on the host's load).\n")
	}
	if r.OK != nil {
		if *r.OK {
			b.WriteString("\nEvery cell passed the harness's checks (below): the exact bytes both ways, on the data path each path claims.\n")
		} else {
			b.WriteString("\n**The harness reported failures**: see the errors in the full report.\n")
		}
	}

	b.WriteString("\n## Bulk transfers: CPU per GiB, every hop\n\n")
	b.WriteString("CPU-s/GiB: CPU seconds of the path's processes per GiB of payload (median of the runs; spread = (max − min) / median). GiB/s: payload over the guest time of the transfer (see the last section for what it means here).\n")
	for _, st := range tables {
		if !isBulk(st.shape) {
			continue
		}
		fmt.Fprintf(&b, "\n### `%s`\n\n", st.shape)
		mdHeader(&b, "path", "runs", "CPU-s/GiB, all hops", "spread", "gateway", "forwarder", "÷ l7-l7 (CPU/GiB)", "GiB/s", "÷ l7-l7 (GiB/s)")
		for _, res := range gatewayRows(st) {
			cpu := res.cpu()
			sp, spok := cpu.spread()
			gw, fw := hopCPU(res, "gateway"), hopCPU(res, "forwarder")
			cr, crok := st.cpuRatio(res, oldPath)
			tr, trok := st.throughputRatio(res, oldPath)
			mdRow(&b, pathName(res.Contender), runsOK(res), opt(cpu.Median, cpu.Median > 0, num), opt(sp, spok, pct),
				gw, fw, opt(cr, crok, times), opt(res.GiBPerS.Median, res.GiBPerS.Median > 0, num), opt(tr, trok, times))
		}
	}

	b.WriteString("\n## Small calls: calls per CPU-second, every hop\n\n")
	b.WriteString("Calls of 1 KiB up and 4 KiB down (unless the sizes above say otherwise). calls/CPU-s: calls over the CPU seconds of the hop (or of all hops); CPU ms/call is its inverse for all hops. p50 and p99: the user's latency per call, in guest time.\n")
	for _, st := range tables {
		if isBulk(st.shape) || !st.hasCalls() {
			continue
		}
		fmt.Fprintf(&b, "\n### `%s`", st.shape)
		if w := gatewayShapes[st.shape]; w != "" {
			fmt.Fprintf(&b, ": %s", w)
		}
		b.WriteString("\n\n")
		mdHeader(&b, "path", "runs", "calls/CPU-s, all hops", "spread", "gateway", "forwarder", "CPU ms/call", "÷ l7-l7 (CPU/call)", "p50 µs", "p99 µs")
		for _, res := range gatewayRows(st) {
			c := res.CallsPerCPUS
			sp, spok := c.spread()
			gw, fw := hopCalls(res, "gateway"), hopCalls(res, "forwarder")
			per, perok := 0.0, c.Median > 0
			if perok {
				per = 1000 / c.Median
			}
			cr, crok := st.callsRatio(res, oldPath)
			if crok {
				cr = 1 / cr // CPU per call, the inverse of calls per CPU
			}
			mdRow(&b, pathName(res.Contender), runsOK(res), opt(c.Median, c.Median > 0, num), opt(sp, spok, pct), gw, fw,
				opt(per, perok, num), opt(cr, crok && cr > 0, times), opt(res.P50US, res.P50US > 0, num), opt(res.P99US, res.P99US > 0, num))
		}
	}

	b.WriteString("\n## Beside the published design\n\n")
	fmt.Fprintf(&b, "The published design measured ×%s throughput and ×%s CPU per GB for its move from L7 to L4. The same ratios here, each path ÷ `l7-l7` of the same run (bulk shapes; CPU of both hops; throughput in guest time):\n\n", num(publishedThroughput), num(publishedCPU))
	mdHeader(&b, "figure", "published, L7 → L4", "`l7-l4` ÷ `l7-l7` (upload / download)", "`l4-l4` ÷ `l7-l7` (upload / download)")
	// bulkCell is name's ratio to oldPath in each bulk shape.
	bulkCell := func(name string, cpu bool) string {
		var parts []string
		for _, st := range tables {
			if isBulk(st.shape) {
				v, ok := st.throughputRatio(st.by[name], oldPath)
				if cpu {
					v, ok = st.cpuRatio(st.by[name], oldPath)
				}
				parts = append(parts, opt(v, ok, times))
			}
		}
		return strings.Join(parts, " / ")
	}
	mdRow(&b, "throughput", times(publishedThroughput), bulkCell("l7-l4", false), bulkCell("l4-l4", false))
	mdRow(&b, "CPU per GB", times(publishedCPU), bulkCell("l7-l4", true), bulkCell("l4-l4", true))
	var small []string
	for _, st := range tables {
		if isBulk(st.shape) || !st.hasCalls() {
			continue
		}
		var parts []string
		for _, name := range []string{"l7-l4", "l4-l4"} {
			if st.by[name] == nil {
				continue
			}
			v, ok := st.callsRatio(st.by[name], oldPath)
			if ok && v > 0 {
				parts = append(parts, fmt.Sprintf("`%s` %s", name, times(1/v)))
			}
		}
		if len(parts) > 0 {
			small = append(small, fmt.Sprintf("`%s`: %s", st.shape, strings.Join(parts, ", ")))
		}
	}
	if len(small) > 0 {
		fmt.Fprintf(&b, "\nCPU per small call, ÷ `l7-l7`'s: %s.\n", strings.Join(small, "; "))
	}

	b.WriteString("\n## What the icount model can say, and what it cannot\n\n")
	b.WriteString(gatewayLimitsText)
	return b.Bytes()
}

// gatewayRows are a shape's chains in report order, then the references.
func gatewayRows(st shapeTable) []*Result {
	var out []*Result
	for _, p := range gatewayPaths {
		if res := st.by[p.name]; res != nil {
			out = append(out, res)
		}
	}
	for _, name := range gatewayRefs {
		if res := st.by[name]; res != nil {
			out = append(out, res)
		}
	}
	return out
}

func pathName(name string) string {
	for _, ref := range gatewayRefs {
		if name == ref {
			return "`" + name + "` (one proxy, for reference)"
		}
	}
	return "`" + name + "`"
}

func hopOf(res *Result, name string) *Hop {
	for i := range res.Hops {
		if res.Hops[i].Name == name {
			return &res.Hops[i]
		}
	}
	return nil
}

// hopCPU is a hop's CPU-s/GiB with its share of the path's.
func hopCPU(res *Result, name string) string {
	h := hopOf(res, name)
	if h == nil || h.CPUPerGiB.Median == 0 {
		return dash
	}
	s := num(h.CPUPerGiB.Median)
	if all := res.cpu().Median; all > 0 {
		s += fmt.Sprintf(" (%s %%)", num(h.CPUPerGiB.Median/all*100))
	}
	return s
}

func hopCalls(res *Result, name string) string {
	h := hopOf(res, name)
	if h == nil || h.CallsPerCPUS.Median == 0 {
		return dash
	}
	return num(h.CallsPerCPUS.Median)
}

// throughputRatio divides two contenders' median GiB/s.
func (st shapeTable) throughputRatio(res *Result, to string) (float64, bool) {
	if res == nil || st.by[to] == nil {
		return 0, false
	}
	a, b := res.GiBPerS.Median, st.by[to].GiBPerS.Median
	return ratio(a, a > 0, b, b > 0)
}

// paramText is the run's sizes in words.
func paramText(r *Results) string {
	get := func(k string) string {
		v, ok := r.Params[k]
		if !ok {
			return ""
		}
		return string(v)
	}
	var parts []string
	if v := get("bulk_bytes"); v != "" {
		var n float64
		fmt.Sscan(v, &n)
		parts = append(parts, bytesIEC(n)+" per bulk run")
	}
	if v := get("repetitions"); v != "" {
		parts = append(parts, v+" runs per cell")
	}
	if c, n := get("small_conns"), get("small_calls"); c != "" && n != "" {
		parts = append(parts, fmt.Sprintf("%s calls over %s reused connections per small-reuse run", n, c))
	}
	if v := get("small_per_call_calls"); v != "" {
		parts = append(parts, v+" calls (one connection each) per per-call run")
	}
	if q, p := get("small_req"), get("small_resp"); q != "" && p != "" {
		parts = append(parts, fmt.Sprintf("%s B up, %s B down per call", q, p))
	}
	return strings.Join(parts, "; ")
}

const gatewayLimitsText = `- **What it measures well: work per byte and per call.** The VM has one
  vCPU, and qemu's ` + "`-icount shift=0`" + ` makes guest time count executed
  instructions (1 ns each). A process's CPU seconds are its instruction
  count, its own code and the kernel's work on its behalf (kTLS's AES-GCM,
  TCP, splice) alike: repeatable to a few percent, blind to the host's load,
  and comparable between the paths of one run. The CPU ratios above say how
  much less work a path does than the old one, and on which hop.
- **Throughput here is a cost model, not a speed.** On one vCPU every party
  runs in turn: the bench's client (the user, with userspace TLS and a
  SHA-256 of every byte), the gateway, the forwarder and the app. A
  transfer's guest time is about the sum of all their instructions, so
  GiB/s here is the inverse of the whole path's cost, the client's and the
  app's included, which no path changes. A throughput ratio is therefore
  smaller than the inverse of the CPU ratio, and it cannot show what a
  faster hop does on real hardware: hops on separate cores or hosts working
  in parallel, a NIC, latency between gateway and forwarder (loopback
  here).
- **Every instruction weighs the same.** An AES round, a byte of a copy and
  a syscall entry each cost 1 ns; on hardware copies cost memory bandwidth
  and cache misses, crypto runs at AES-NI speed, and the balance between
  them differs from this model's. Absolute CPU seconds are not native
  figures; the ratios are the comparable part, and only as far as the two
  paths spend their instructions alike.
- **So, against the published design's figures.** Its ×3.56 throughput and
  ×0.155 CPU per GB were measured natively. The CPU ratio is the figure
  this run can confirm or refute in direction and rough size; the
  throughput ratio it cannot reproduce, since here the user's own TLS and
  hashing share the one vCPU with the path. The host has no kTLS, so
  ` + "`integration/bench.sh --native -contenders l7-l7,l7-l4,l4-l4`" + ` on a kernel
  with kTLS is the way to a native figure.
- **Tunnels: pooled at L7, one per connection at L4.** The L7 gateways
  keep their forwarder connections (32 idle per upstream or route), so a
  user's new connection costs them one userspace TLS handshake and nothing
  behind it. An L4 gateway cannot pool: every user connection is a tunnel
  of its own, a mutual TLS handshake (Go's default key exchange,
  X25519MLKEM768, on this hop; the user's is pinned to X25519) and a signed
  preamble on the gateway and on the forwarder. Since the gateway resumes
  its forwarder sessions (` + "`resumption`" + `, on by default) a tunnel after the
  first verifies and signs no certificate, but its key exchange, the
  preamble's signature and verification, and the key installs of three
  kTLS sockets remain. A connection-per-call workload pays that on every
  call, which the small-per-call rows show.
- **Not in the model:** NIC TLS offload, multi-core scaling, many
  concurrent tunnels' memory, HTTP/2 to the app (the L7 hops speak
  HTTP/1.1 here; ` + "`versions h2c`" + ` exists), and the gateway's placeholder
  routing and lookup (one static route here).

How the cells were checked (the harness's checks, in every cell of every
path): the SHA-256 of the bytes both ways (an upload's app answers the count
and SHA-256 of all it received); the negotiated TLS 1.3 suite on the user's
connection; and ` + "`/proc/net/tls_stat`" + `'s key installs over the cell against
the path's claim, counted per forwarder tunnel (a connection the app
accepts): ` + "`l4-l4`" + ` 3 per tunnel each way (the gateway's user socket, its
forwarder socket and the forwarder's), ` + "`l7-l4`" + ` 2 (the gateway's ` + "`ktls.Client`" + `
socket and the forwarder's; the gateway's warm-up tunnels, which later cells
reuse from its pool, are checked at the warm-up), ` + "`l7-l7`" + ` none. The traced
pass checks ` + "`l4-l4`" + `'s gateway moves no payload byte through userspace: after
its key installs, at most a preamble per tunnel and a close_notify each way
on each of its two kTLS sockets.
`

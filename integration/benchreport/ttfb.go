package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

// The goal of issue 34 this run answers: a new connection's time to first
// byte through l4-l4 with standby connections at most l7-l7's, at 20 ms
// RTT between gateway and forwarder.
const (
	ttfbGoalRTT     = 20.0
	ttfbGoalSubject = "l4-l4-standby"
	ttfbGoalBase    = "l7-l7"
)

// parseTTFB reads the JSON of a time-to-first-byte run (bench ttfb).
func parseTTFB(data []byte) (*benchjson.TTFBReport, error) {
	var t benchjson.TTFBReport
	if err := json.Unmarshal(data, &t); err != nil {
		return nil, err
	}
	if t.Kind != benchjson.TTFBKind {
		return nil, fmt.Errorf("kind %q, want %s (a bench ttfb document)", t.Kind, benchjson.TTFBKind)
	}
	if len(t.Results) == 0 {
		return nil, errors.New("no results")
	}
	return &t, nil
}

// msCell formats milliseconds: two decimals below 10, one above; "–"
// for none.
func msCell(v float64) string {
	switch {
	case v == 0:
		return "–"
	case v < 10:
		return fmt.Sprintf("%.2f", v)
	}
	return fmt.Sprintf("%.1f", v)
}

// msSigned formats a difference of milliseconds as msCell does, with its
// sign, "0" for none.
func msSigned(v float64) string {
	switch {
	case v == 0:
		return "0"
	case v < 0:
		return "−" + msCell(-v)
	}
	return "+" + msCell(v)
}

// ttfbResult is the result of contender at rtt, or nil.
func ttfbResult(t *benchjson.TTFBReport, contender string, rtt float64) *benchjson.TTFBResult {
	i := slices.IndexFunc(t.Results, func(r *benchjson.TTFBResult) bool { return r.Contender == contender && r.RTTMs == rtt })
	if i < 0 {
		return nil
	}
	return t.Results[i]
}

// ttfbPath is the path check at rtt, or nil.
func ttfbPath(t *benchjson.TTFBReport, rtt float64) *benchjson.Path {
	i := slices.IndexFunc(t.Paths, func(p *benchjson.Path) bool { return p.RTTMs == rtt })
	if i < 0 {
		return nil
	}
	return t.Paths[i]
}

// ttfbMeasured says whether r has figures to compare: connections
// measured, and the delay at its RTT checked and in place.
func ttfbMeasured(t *benchjson.TTFBReport, r *benchjson.TTFBResult) bool {
	if r == nil || r.N == 0 {
		return false
	}
	p := ttfbPath(t, r.RTTMs)
	return p != nil && p.OK && len(p.Errors) == 0
}

// ttfbContenders are the contenders of t in the order measured.
func ttfbContenders(t *benchjson.TTFBReport) []string {
	var out []string
	for _, r := range t.Results {
		if !slices.Contains(out, r.Contender) {
			out = append(out, r.Contender)
		}
	}
	return out
}

// ttfbRTTs are the RTTs of t, ascending.
func ttfbRTTs(t *benchjson.TTFBReport) []float64 {
	var out []float64
	for _, r := range t.Results {
		if !slices.Contains(out, r.RTTMs) {
			out = append(out, r.RTTMs)
		}
	}
	slices.Sort(out)
	return out
}

// ratioCell is a ÷ b as "×0.93", "–" without both.
func ratioCell(a, b float64) string {
	if a == 0 || b == 0 {
		return "–"
	}
	return fmt.Sprintf("×%.2f", a/b)
}

// renderTTFBMarkdown writes docs/bench/ttfb.md from a ttfb run.
func renderTTFBMarkdown(t *benchjson.TTFBReport, source string) []byte {
	var b bytes.Buffer
	p := &t.Params
	writeTitle(&b, "Time to first byte through the gateway chains (issue 34)", "integration/benchreport", []string{source})
	b.WriteString("\n\n")
	if t.Label != "" {
		fmt.Fprintf(&b, "**%s.**\n\n", t.Label)
	}
	commit := t.Commit
	if len(commit) >= 40 {
		commit = commit[:12] + commit[40:] // keeps a "-dirty"
	}
	fmt.Fprintf(&b, "Measured %s on commit `%s`, mode `%s`, kernel %s, the client on %d CPU(s) (%s, %s).\n\n", t.Date, commit, t.Mode, t.Kernel, t.CPUs, t.Host, t.Go)
	fmt.Fprintf(&b, "Every chain runs at once. At each RTT between gateway and forwarder (%s ms): one uncounted connection per chain, %g ms of quiet, then %d rounds of one new connection per chain, the chains in turn, each connection followed by %g ms + 3 RTT of quiet; each makes one call of %d B up and %d B down. `%s` is `l4-l4` with `standby %d` on the gateway. The forwarder hops listen on %s, and netem on `%s` delays every packet to or from that address by half the RTT.",
		joinFloats(p.RTTsMs), p.SettleMs, p.Conns, p.PauseMs, p.Req, p.Resp, ttfbGoalSubject, p.Standby, p.ForwarderAddr, p.Device)
	if p.PinContender != "" {
		fmt.Fprintf(&b, " The chains' processes run on CPU %s, the client (and the upstream, in its process) on the others.", p.PinContender)
	}
	b.WriteString("\n\n")
	if t.Mode == "vm" {
		b.WriteString(ttfbSetup)
	} else {
		fmt.Fprintf(&b, "Mode %s: wall-clock time on the host named above, not the VM setup the committed figures use.\n\n", t.Mode)
	}

	contenders, rtts := ttfbContenders(t), ttfbRTTs(t)
	b.WriteString("## Time to first byte\n\nFrom the start of a new connection's TCP connect to the gateway to the first byte of its response, in ms (the fastest, nearest-rank percentiles and the slowest of the *n* connections measured); *÷ l7-l7* is the p50 over `l7-l7`'s at the same RTT; *first* is the uncounted first connection's; *netem pkts/conn*: packets the netem qdisc held in the contender's turns, per connection (a connection and the quiet after it, a standby refill's packets included); *fwd. conns*: established connections to its forwarder's listener after the last round (the pooled tunnels, or the standby connections).\n")
	for _, rtt := range rtts {
		fmt.Fprintf(&b, "\n### %g ms RTT between gateway and forwarder\n\n", rtt)
		b.WriteString("| contender | n | failed | min | p50 | p90 | p99 | max | p50 ÷ l7-l7 | first | netem pkts/conn | fwd. conns |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		base := ttfbResult(t, ttfbGoalBase, rtt)
		for _, c := range contenders {
			r := ttfbResult(t, c, rtt)
			if r == nil {
				continue
			}
			ratio := "–"
			if ttfbMeasured(t, r) && ttfbMeasured(t, base) {
				ratio = ratioCell(r.P50Ms, base.P50Ms)
			}
			perConn := "–"
			if r.N+r.Failed > 0 {
				perConn = fmt.Sprintf("%.1f", float64(r.NetemPackets)/float64(r.N+r.Failed))
			}
			fmt.Fprintf(&b, "| `%s` | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %d |\n", c, r.N, r.Failed, msCell(r.MinMs), msCell(r.P50Ms), msCell(r.P90Ms), msCell(r.P99Ms), msCell(r.MaxMs), ratio, msCell(r.WarmupMs), perConn, r.ForwarderConns)
		}
	}

	if len(rtts) >= 2 {
		lo, hi := rtts[0], rtts[len(rtts)-1]
		fmt.Fprintf(&b, "\n## Round trips across the path\n\nThe p50's slope between %g and %g ms RTT: the gateway↔forwarder round trips a new connection waits for. The CPU time of both hops and of the client drops out as far as it is the same at both RTTs (the notes say where it is not). A tunnel of its own takes 3 (connect, TLS handshake, then the preamble and the call), a standby connection or a pooled tunnel 1.\n\n", lo, hi)
		fmt.Fprintf(&b, "| contender | p50 at %g ms | p50 at %g ms | round trips |\n|---|---:|---:|---:|\n", lo, hi)
		for _, c := range contenders {
			a, z := ttfbResult(t, c, lo), ttfbResult(t, c, hi)
			if !ttfbMeasured(t, a) || !ttfbMeasured(t, z) {
				fmt.Fprintf(&b, "| `%s` | – | – | – |\n", c)
				continue
			}
			fmt.Fprintf(&b, "| `%s` | %s | %s | %.2f |\n", c, msCell(a.P50Ms), msCell(z.P50Ms), (z.P50Ms-a.P50Ms)/(hi-lo))
		}
	}

	fmt.Fprintf(&b, "\n## The goal: `%s` ≤ `%s` at %g ms RTT\n\n", ttfbGoalSubject, ttfbGoalBase, ttfbGoalRTT)
	subject, base := ttfbResult(t, ttfbGoalSubject, ttfbGoalRTT), ttfbResult(t, ttfbGoalBase, ttfbGoalRTT)
	if !ttfbMeasured(t, subject) || !ttfbMeasured(t, base) {
		b.WriteString("Not measured in this run.\n")
	} else {
		verdict := func(a, z float64) string {
			if a <= z {
				return fmt.Sprintf("met, by %s ms", msCell(z-a))
			}
			return fmt.Sprintf("missed, by %s ms", msCell(a-z))
		}
		fmt.Fprintf(&b, "- p50: %s against %s ms (%s): **%s**.\n", msCell(subject.P50Ms), msCell(base.P50Ms), ratioCell(subject.P50Ms, base.P50Ms), verdict(subject.P50Ms, base.P50Ms))
		fmt.Fprintf(&b, "- p90: %s against %s ms (%s): %s.\n", msCell(subject.P90Ms), msCell(base.P90Ms), ratioCell(subject.P90Ms, base.P90Ms), verdict(subject.P90Ms, base.P90Ms))
	}

	fmt.Fprintf(&b, "\n## Path checks\n\nPer RTT, the fastest of the probes' TCP connects (one round trip each) from the client to a listener of its own on the forwarders' address, before the delay was installed and with it (*forwarder before / with*): the delay *added* their difference, which must fall in *band*. The same to a listener on 127.0.0.1 (*127.0.0.1 before / with*) must grow by less than *bound*. *probes*: the connects each figure with the delay is the fastest of (batches of %d until the check passed; %d before it).\n\n", t.Params.Probes, t.Params.Probes)
	b.WriteString("| RTT | forwarder before / with | added | band | 127.0.0.1 before / with | added | bound | probes | check |\n|---:|---:|---:|---|---:|---:|---:|---:|---|\n")
	for _, q := range t.Paths {
		check := "ok"
		if !q.OK || len(q.Errors) > 0 {
			check = "**failed**"
		}
		fmt.Fprintf(&b, "| %g | %s / %s | %s | %s–%s | %s / %s | %s | < %s | %d | %s |\n", q.RTTMs, msCell(q.ForwarderBeforeMs), msCell(q.ForwarderMs), msSigned(q.AddedMs),
			msCell(q.LowMs), msCell(q.HighMs), msCell(q.LocalBeforeMs), msCell(q.LocalMs), msSigned(q.LocalAddedMs), msCell(q.LocalHighMs), q.Batches*t.Params.Probes, check)
	}
	if len(t.Paths) > 0 && len(t.Paths[0].Commands) > 0 {
		fmt.Fprintf(&b, "\nThe delay at %g ms RTT:\n\n```sh\n%s\n```\n", t.Paths[0].RTTMs, strings.Join(t.Paths[0].Commands, "\n"))
	}

	var failures []string
	for _, q := range t.Paths {
		for _, e := range q.Errors {
			failures = append(failures, fmt.Sprintf("- at %g ms: %s", q.RTTMs, e))
		}
	}
	for _, r := range t.Results {
		for _, e := range r.Errors {
			failures = append(failures, fmt.Sprintf("- `%s` at %g ms: %s", r.Contender, r.RTTMs, e))
		}
	}
	for _, s := range t.Skipped {
		failures = append(failures, fmt.Sprintf("- `%s` not run: %s", s.Contender, s.Reason))
	}
	if len(failures) > 0 {
		fmt.Fprintf(&b, "\n## Failures\n\n%s\n", strings.Join(failures, "\n"))
	}
	b.WriteString("\n## Notes\n\n")
	for _, n := range t.Notes {
		fmt.Fprintf(&b, "- %s\n", n)
	}
	return b.Bytes()
}

// ttfbSetup is what the setup can and cannot show.
const ttfbSetup = `## What this setup can and cannot show

The run is a real-time VM (qemu TCG, multi-threaded, two vCPUs, no
` + "`-icount`" + `): the Caddy processes of every chain are pinned to one vCPU,
the client and the upstream to the other. TCG runs guest code 10–50× slower
than native, so the CPU part of each figure (the client's TLS handshake with
the gateway, the gateway's and the forwarder's work) is far above a native
one, and it varies with the host's load: absolute milliseconds are not
native ones. What counts is the comparison between the contenders at the
same RTT, whose connections alternate, so that a spell of load on the host
falls on each alike, and the round trips across the delayed path, which the
slope between two RTTs gives without the CPU time.

`

package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

// parseLoad reads the JSON of a load run (bench load).
func parseLoad(data []byte) (*benchjson.LoadReport, error) {
	var l benchjson.LoadReport
	if err := json.Unmarshal(data, &l); err != nil {
		return nil, err
	}
	if l.Kind != benchjson.LoadKind {
		return nil, fmt.Errorf("kind %q, want %s (a bench load document)", l.Kind, benchjson.LoadKind)
	}
	if len(l.Results) == 0 {
		return nil, errors.New("no results")
	}
	return &l, nil
}

// ms formats microseconds as milliseconds.
func ms(us float64) string {
	switch {
	case us == 0:
		return "–"
	case us < 10_000:
		return fmt.Sprintf("%.2f", us/1000)
	}
	return fmt.Sprintf("%.1f", us/1000)
}

// errorCell is a step's errors by class ("0" for none), and its saturated
// arrivals apart.
func errorCell(s *benchjson.Step) string {
	var parts []string
	for _, c := range benchjson.Classes {
		if n := s.Errors[c]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", c, n))
		}
	}
	if len(parts) == 0 {
		return "0"
	}
	return strings.Join(parts, ", ")
}

// renderLoadMarkdown writes docs/bench/load.md from a load run.
func renderLoadMarkdown(l *benchjson.LoadReport, source string) []byte {
	var b bytes.Buffer
	p := &l.Params
	writeTitle(&b, "Under load: latency against offered load (issue 34)", "integration/benchreport", []string{source})
	b.WriteString("\n\n")
	if l.Label != "" {
		fmt.Fprintf(&b, "**%s.**\n\n", l.Label)
	}
	commit := l.Commit
	if len(commit) >= 40 {
		commit = commit[:12] + commit[40:] // keeps a "-dirty"
	}
	fmt.Fprintf(&b, "Measured %s on commit `%s`, mode `%s`, kernel %s, the generator on %d CPU(s) (%s, %s).\n\n", l.Date, commit, l.Mode, l.Kernel, l.CPUs, l.Host, l.Go)
	fmt.Fprintf(&b, "Calls of %d B up and %d B down; %d tunnels (reuse) or connections in flight at most (per-call); ", p.Req, p.Resp, p.Tunnels)
	if chainsOnly := !slices.ContainsFunc(l.Results, func(r *benchjson.LoadResult) bool { return !isChain(r) }); chainsOnly {
		b.WriteString("the gateway chains reach one upstream; ")
	} else {
		fmt.Fprintf(&b, "%d sandbox targets behind the forwarder; ", p.Targets)
	}
	if len(p.Rates) > 0 {
		fmt.Fprintf(&b, "fixed rates %s calls/s, %g s each", joinFloats(p.Rates), p.StepSeconds)
	} else {
		fmt.Fprintf(&b, "unloaded step %g calls/s for %g s, capacity bound p99 ≤ %g × unloaded p99 with no error, sweep at %s %% of capacity, %g s per step", p.UnloadedRate, p.UnloadedSeconds, p.P99Factor, joinFloats(p.SweepPcts), p.StepSeconds)
	}
	fmt.Fprintf(&b, "; generator deadline %d ms per call; schedule seed %d.", p.CallTimeoutMs, p.Seed)
	if p.PinContender != "" {
		who := "The contender runs"
		if slices.ContainsFunc(l.Results, isChain) {
			who = "The contender (every process of a chain) runs"
		}
		fmt.Fprintf(&b, " %s on CPU %s, the generator (and the upstream, in its process) on the others.", who, p.PinContender)
	}
	if p.MaxHandshakes != 0 {
		fmt.Fprintf(&b, " The forwarder's (and an `l4-l4` gateway's) `max_handshakes` was %d (-1: no bound).", p.MaxHandshakes)
	}
	if p.MaxSchedulingDelay != "" {
		fmt.Fprintf(&b, " The forwarder's (and an `l4-l4` gateway's) `max_scheduling_delay` was %s.", p.MaxSchedulingDelay)
	}
	b.WriteString("\n\n")
	if l.Mode == "vm" {
		b.WriteString(loadSetup)
	} else {
		fmt.Fprintf(&b, "Mode %s: wall-clock time on the host named above, not the VM setup the committed figures use; the generator and the contender share its CPUs unless the contender is pinned.\n\n", l.Mode)
	}

	genCPUs, contCPUs := l.CPUs, cpuListLen(p.PinContender)
	if contCPUs == 0 {
		contCPUs = l.CPUs
	}
	b.WriteString("## Capacity\n\n*Busy at 100 %* says whose CPU was near a full core (0.85 or more) in the step at capacity: where it is the generator's alone, the capacity is the generator's and a lower bound of the contender's.\n\n")
	if genCPUs > 1 || contCPUs > 1 {
		fmt.Fprintf(&b, "Here a side is busy at 0.85 of its CPUs: the generator had %d, the contender %d.\n\n", genCPUs, contCPUs)
	}
	// The user connections' handshakes have a column only in runs that
	// recorded them.
	userTLS := slices.ContainsFunc(l.Results, func(r *benchjson.LoadResult) bool { return r.Handshakes > 0 })
	if userTLS {
		b.WriteString("*User TLS* is what the generator's connections paid at the contender (a chain's gateway) over the shape: their TLS handshakes and how many resumed a session (per-call: one per call; reuse: one per tunnel opened, a failed one opened again).\n\n")
		b.WriteString("| contender | shape | unloaded p99 (ms) | capacity (calls/s) | busy at 100 % | goodput 200 % / 100 % | errors at the highest rate | user TLS | data path |\n|---|---|---:|---:|---|---:|---|---|---|\n")
	} else {
		b.WriteString("| contender | shape | unloaded p99 (ms) | capacity (calls/s) | busy at 100 % | goodput 200 % / 100 % | errors at the highest rate | data path |\n|---|---|---:|---:|---|---:|---|---|\n")
	}
	for _, r := range l.Results {
		unloaded, capacity, ratio, top, busy := "–", "–", "–", "–", "–"
		if i := slices.IndexFunc(r.Steps, func(s benchjson.Step) bool { return s.Pct == 100 }); i >= 0 {
			busy = busyCell(&r.Steps[i], genCPUs, contCPUs)
		}
		if r.Unloaded != nil {
			unloaded = ms(r.Unloaded.P99us)
		}
		if r.Capacity > 0 {
			capacity = fmt.Sprintf("%.0f", r.Capacity)
			if !slices.ContainsFunc(r.Search, func(s benchjson.Step) bool { return s.Rate > r.Capacity }) {
				// No step failed the bound: the search stopped at its
				// highest rate (params.max_rate).
				capacity = "≥ " + capacity + " (no search step failed)"
			}
		}
		// From the sweep's steps, so that a collapse to no goodput at
		// 200 % shows as 0.
		if c := goodputCell(sweepStep(r, 100), sweepStep(r, 200), genCPUs); c != "" {
			ratio = c
		}
		if len(r.Steps) > 0 {
			last := &r.Steps[len(r.Steps)-1]
			top = errorCell(last)
			if last.Saturated > 0 {
				top += fmt.Sprintf(" (+%d generator-saturated)", last.Saturated)
			}
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s | %s | %s |", r.Contender, r.Shape, unloaded, capacity, busy, ratio, top)
		if userTLS {
			fmt.Fprintf(&b, " %s |", userTLSCell(r))
		}
		fmt.Fprintf(&b, " %s |\n", r.Offload)
	}
	for _, s := range l.Skipped {
		fmt.Fprintf(&b, "\n- `%s` not run: %s", s.Contender, s.Reason)
	}
	b.WriteString("\n\n## Latency per offered rate\n\nLatency from each call's scheduled arrival to its verified response, in ms; goodput is calls completed within the step per second; errors by class; *sat.* counts arrivals that found no free slot (the generator's limit: not started, not the contender's); *lag* is the generator's own lateness (p99), inside the latencies; *gen* its CPU in cores (the upstream's included), *cont.* the contender's; *settle* how long the step first waited for the contender to go idle (work an earlier, overloaded step left it).")
	// The contender's memory has a column only in runs that recorded it
	// (before, bench load did not): a step without it shows "–".
	memory := slices.ContainsFunc(l.Results, func(r *benchjson.LoadResult) bool { return slices.ContainsFunc(resultSteps(r), hasMemory) })
	if memory {
		b.WriteString(" The last column, *cont. RSS MiB / fds*, is the contender's resident memory and open file descriptors at the step's end, its tunnels and the calls still in flight included (– where a step did not record them).")
	}
	if slices.ContainsFunc(l.Results, isChain) {
		b.WriteString(" A gateway chain's table has one more column, *per hop*: each process's CPU in cores, resident memory in MiB and open fds at the step's end, the gateway first (*cont.* and the memory column are their sums).")
	}
	b.WriteString("\n")
	for _, r := range l.Results {
		fmt.Fprintf(&b, "\n### `%s`, %s\n\n", r.Contender, r.Shape)
		chain := isChain(r)
		header, align := "| step | offered/s | % cap. | offered | completed | goodput/s | p50 | p99 | p99.9 | max | errors | sat. | lag p99 | gen | cont. | settle (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
		if memory {
			header, align = header+" cont. RSS MiB / fds |", align+"---:|"
		}
		if chain {
			header, align = header+" per hop: cores, RSS MiB / fds |", align+"---|"
		}
		b.WriteString(header + "\n" + align + "\n")
		row := func(kind string, s *benchjson.Step) {
			pct := "–"
			if s.Pct > 0 {
				pct = fmt.Sprintf("%g", s.Pct)
			}
			fmt.Fprintf(&b, "| %s | %.0f | %s | %d | %d | %.1f | %s | %s | %s | %s | %s | %d | %s | %.2f | %.2f | %.1f |", kind, s.Rate, pct, s.Offered, s.Completed, s.Goodput,
				ms(s.P50us), ms(s.P99us), ms(s.P999us), ms(s.MaxUs), errorCell(s), s.Saturated, ms(s.LagP99us), s.GenCPU, s.ContenderCPU, s.SettleSeconds)
			if memory {
				fmt.Fprintf(&b, " %s |", memoryCell(s))
			}
			if chain {
				fmt.Fprintf(&b, " %s |", hopsCell(s))
			}
			b.WriteString("\n")
		}
		if r.Unloaded != nil {
			row("unloaded", r.Unloaded)
		}
		for i := range r.Search {
			row("search", &r.Search[i])
		}
		for i := range r.Steps {
			kind := "sweep"
			if len(p.Rates) > 0 {
				kind = "fixed"
			}
			row(kind, &r.Steps[i])
		}
		if r.Fairness != nil {
			row(fmt.Sprintf("+%d bulk", r.Fairness.Bulk), r.Fairness)
		}
		for _, e := range r.Errors {
			fmt.Fprintf(&b, "\nFAILED: %s\n", e)
		}
	}

	writeChains(&b, l)

	fair := slices.IndexFunc(l.Results, func(r *benchjson.LoadResult) bool { return r.Fairness != nil && r.Baseline != nil })
	if fair >= 0 {
		fmt.Fprintf(&b, "\n## Fairness: small calls beside bulk tunnels\n\nThe same rate with and without %d bulk tunnels streaming %d MiB transfers (half of them downloads, half uploads) through the same contender: does a bulk transfer hold up small calls? The bulk tunnels' payload, checksums and TLS run in the generator's process, on its vCPU: where the bulk step's *gen* is near 1 core (the +bulk rows above), the rise in p99 is the generator's as much as the contender's, and the ratio says nothing about the contender's fairness.\n\n", p.Bulk, p.BulkBytes>>20)
		b.WriteString("| contender | shape | offered/s | p99 without (ms) | p99 with (ms) | with / without | bulk MiB moved | small-call errors with bulk | bulk errors |\n|---|---|---:|---:|---:|---:|---:|---|---:|\n")
		for _, r := range l.Results {
			if r.Fairness == nil || r.Baseline == nil {
				continue
			}
			ratio := "–"
			if r.Baseline.P99us > 0 {
				ratio = fmt.Sprintf("%.2f", r.Fairness.P99us/r.Baseline.P99us)
			}
			fmt.Fprintf(&b, "| `%s` | %s | %.0f | %s | %s | %s | %d | %s | %d |\n", r.Contender, r.Shape, r.Fairness.Rate, ms(r.Baseline.P99us), ms(r.Fairness.P99us), ratio,
				r.Fairness.BulkBytes>>20, errorCell(r.Fairness), r.Fairness.BulkErrors)
		}
	}

	held := slices.ContainsFunc(l.Results, func(r *benchjson.LoadResult) bool { return r.Shape == "reuse" && r.RSSBefore > 0 })
	if held {
		fmt.Fprintf(&b, "\n## Memory of the tunnels held\n\nThe reuse shape holds %d tunnels open while calls run on them: the contender's resident memory and open fds just before it opened them and at the step where its memory peaked (the bulk step included), and the difference per tunnel. Resident memory is the process's (Go heap, stacks and what the runtime has not returned), not the kernel's socket buffers or pipes; each pipe a burst holds is 2 of the fds.\n\n", p.Tunnels)
		b.WriteString("| contender | RSS before (MiB) | RSS at its peak (MiB) | at step (calls/s) | per tunnel (KiB) | fds before | fds at that step | per tunnel |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, r := range l.Results {
			if r.Shape != "reuse" || r.RSSBefore == 0 {
				continue
			}
			steps := resultSteps(r)
			i := -1
			for j := range steps {
				if i < 0 || steps[j].ContenderRSS > steps[i].ContenderRSS {
					i = j
				}
			}
			if i < 0 || steps[i].ContenderRSS == 0 {
				continue
			}
			peak := steps[i]
			n := float64(max(p.Tunnels, 1))
			fmt.Fprintf(&b, "| `%s` | %.1f | %.1f | %.0f | %.1f | %d | %d | %.2f |\n", r.Contender, float64(r.RSSBefore)/(1<<20), float64(peak.ContenderRSS)/(1<<20), peak.Rate,
				float64(peak.ContenderRSS-r.RSSBefore)/1024/n, r.FDsBefore, peak.ContenderFDs, float64(peak.ContenderFDs-r.FDsBefore)/n)
		}
	}
	if slices.ContainsFunc(l.Results, func(r *benchjson.LoadResult) bool { return len(r.GoMemory) > 0 }) {
		b.WriteString("\nWhat the Go runtime of each Caddy process held per tunnel once the reuse shape's tunnels were open (the change from just before they opened, each figure read right after a garbage collection): the live heap, the heap's spans in use, the goroutine stacks, and goroutines. Resident memory adds the heap's growth room (the next collection's target) and what the runtime has not returned. A chain's processes are one row each, the gateway first.\n\n")
		b.WriteString("| contender | process | live heap (KiB) | heap in use (KiB) | stacks (KiB) | goroutines |\n|---|---|---:|---:|---:|---:|\n")
		for _, r := range l.Results {
			for _, m := range r.GoMemory {
				fmt.Fprintf(&b, "| `%s` | %s | %.1f | %.1f | %.1f | %.2f |\n", r.Contender, m.Name, m.HeapLive/1024, m.HeapInuse/1024, m.Stacks/1024, m.Goroutines)
			}
		}
	}

	b.WriteString("\n## Errors by cause\n\n")
	any := false
	for _, r := range l.Results {
		causes := map[string]int{}
		for _, s := range resultSteps(r) {
			for k, v := range s.Causes {
				causes[k] += v
			}
		}
		if counted := hopFailures(r); counted != "" {
			any = true
			fmt.Fprintf(&b, "- `%s` %s, counted by its processes: %s\n", r.Contender, r.Shape, counted)
		}
		if len(causes) == 0 {
			continue
		}
		any = true
		keys := make([]string, 0, len(causes))
		for k := range causes {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		var parts []string
		for _, k := range keys {
			parts = append(parts, fmt.Sprintf("%s × %d", k, causes[k]))
		}
		fmt.Fprintf(&b, "- `%s` %s: %s\n", r.Contender, r.Shape, strings.Join(parts, "; "))
	}
	if !any {
		b.WriteString("No call failed.\n")
	}
	b.WriteString("\n## Notes\n\n")
	for _, n := range l.Notes {
		fmt.Fprintf(&b, "- %s\n", n)
	}
	return b.Bytes()
}

// resultSteps are the steps of r that its table shows: the search, the
// sweep (or fixed rates), the unloaded step and the fairness step (the
// baseline is one of the sweep's).
func resultSteps(r *benchjson.LoadResult) []benchjson.Step {
	steps := append(append([]benchjson.Step{}, r.Search...), r.Steps...)
	if r.Unloaded != nil {
		steps = append(steps, *r.Unloaded)
	}
	if r.Fairness != nil {
		steps = append(steps, *r.Fairness)
	}
	return steps
}

// hasMemory says whether s recorded the contender's memory.
func hasMemory(s benchjson.Step) bool { return s.ContenderRSS > 0 || s.ContenderFDs > 0 }

// memoryCell is the contender's resident memory in MiB and its open file
// descriptors at the end of s, "–" for what the step did not record.
func memoryCell(s *benchjson.Step) string {
	if !hasMemory(*s) {
		return "–"
	}
	rss, fds := "–", "–"
	if s.ContenderRSS > 0 {
		rss = fmt.Sprintf("%.1f", float64(s.ContenderRSS)/(1<<20))
	}
	if s.ContenderFDs > 0 {
		fds = fmt.Sprintf("%d", s.ContenderFDs)
	}
	return rss + " / " + fds
}

// busyCell says which side was busy in a step: the generator, the
// contender, both (0.85 of its CPUs or more), or neither. A chain's
// contender CPU is its processes' sum, each one's share named.
func busyCell(s *benchjson.Step, genCPUs, contCPUs int) string {
	gen, cont := s.GenCPU >= 0.85*float64(max(genCPUs, 1)), s.ContenderCPU >= 0.85*float64(max(contCPUs, 1))
	cores := fmt.Sprintf(" (gen %.2f, cont. %.2f%s)", s.GenCPU, s.ContenderCPU, hopShares(s))
	switch {
	case gen && cont:
		return "both" + cores
	case gen:
		return "generator" + cores
	case cont:
		return "contender" + cores
	}
	return "neither" + cores
}

// goodputCell is goodput at 200 % over goodput at 100 % ("" without
// both steps or with none at 100 %), marked where the generator's CPU was
// busy (0.85 of its CPUs or more) at 200 %: there the calls also waited for
// the generator's own share of every handshake, so the ratio is a lower
// bound of the contender's, not its figure.
func goodputCell(at100, at200 *benchjson.Step, genCPUs int) string {
	if at100 == nil || at200 == nil || at100.Goodput <= 0 {
		return ""
	}
	cell := fmt.Sprintf("%.2f", at200.Goodput/at100.Goodput)
	if at200.GenCPU >= 0.85*float64(max(genCPUs, 1)) {
		cell += fmt.Sprintf(" (generator busy at 200 %%: gen %.2f)", at200.GenCPU)
	}
	return cell
}

// cpuListLen counts the CPUs of a taskset list ("0", "0,1", "2-15"); 0
// for an empty or unreadable one.
func cpuListLen(list string) int {
	n := 0
	for part := range strings.SplitSeq(list, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			return 0
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil || b < a {
				return 0
			}
		}
		n += b - a + 1
	}
	return n
}

func joinFloats(v []float64) string {
	s := make([]string, len(v))
	for i, f := range v {
		s[i] = fmt.Sprintf("%g", f)
	}
	return strings.Join(s, ", ")
}

// loadSetup is what the load setup can and cannot show.
const loadSetup = `## What this setup can and cannot show

The run is a real-time VM (qemu TCG, multi-threaded, two vCPUs, no
` + "`-icount`" + `): the contender is pinned to one vCPU and the generator, with the
upstream in its process, to the other, so that the generator does not take
the contender's CPU. TCG runs guest code 10–50× slower than native and its
timing depends on the host's load, so absolute latencies and capacities are
not native ones: the comparisons that count are between contenders of one run
(the same VM, the same generator, minutes apart), and the shape of each
contender's curve (where its p99 bends, whether goodput holds past capacity,
which errors it manufactures). The cost model (CPU per call, per GiB) stays
with the ` + "`-icount`" + ` runs of [results.md](results.md); ` + "`-icount`" + ` makes time a count
of instructions and says nothing about latency. Under TCG a halted vCPU
takes milliseconds to wake: at low rates the latencies include those
wake-ups, so a p99 can fall as the rate rises, and the unloaded p99 (and
with it the capacity bound of 10× it) is higher than a native one would be.

The generator runs the client side of every handshake and the upstream on
its one vCPU, about as much TLS work as the contender's: where its CPU (*gen*)
nears 1 core while the contender's (*cont.*) does not, or its lag grows, the
generator, not the contender, is the limit of that step, and the capacity
found is a lower bound of the contender's.

`

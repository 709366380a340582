package main

import (
	"bytes"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

// chainBase is the chain the others are compared with: the old path, an
// L7 gateway in front of an L7 dataplane.
const chainBase = "l7-l7"

// isChain says whether r is a gateway chain's: its steps name its
// processes.
func isChain(r *benchjson.LoadResult) bool {
	return len(r.HopsBefore) > 1 || slices.ContainsFunc(resultSteps(r), func(s benchjson.Step) bool { return len(s.Hops) > 1 })
}

// hopShares names each process's share of a chain step's CPU (" =
// gateway 0.60 + forwarder 0.35"); "" for one process.
func hopShares(s *benchjson.Step) string {
	if len(s.Hops) < 2 {
		return ""
	}
	parts := make([]string, len(s.Hops))
	for i, h := range s.Hops {
		parts[i] = fmt.Sprintf("%s %.2f", h.Name, h.CPU)
	}
	return " = " + strings.Join(parts, " + ")
}

// hopsCell is a chain step's figures per process: CPU in cores, resident
// memory in MiB and open fds, the gateway first.
func hopsCell(s *benchjson.Step) string {
	if len(s.Hops) == 0 {
		return "–"
	}
	parts := make([]string, len(s.Hops))
	for i, h := range s.Hops {
		parts[i] = fmt.Sprintf("%s %.2f, %.1f / %d", h.Name, h.CPU, float64(h.RSS)/(1<<20), h.FDs)
	}
	return strings.Join(parts, "; ")
}

// userTLSCell is what the user connections' TLS cost at the contender
// over a shape: their handshakes, and how many resumed.
func userTLSCell(r *benchjson.LoadResult) string {
	if r.Handshakes == 0 {
		return "–"
	}
	return fmt.Sprintf("%d handshakes, %d resumed", r.Handshakes, r.Resumed)
}

// isFailureSeries says whether a counter series counts a failure or a
// connection left in userspace: not a gateway's ok dial or its
// resumption, a tunnel closed in order, a standby connection used, a
// handshake offloaded both ways, or a direction offloaded.
func isFailureSeries(series string) bool {
	name, _, _ := strings.Cut(series, "{")
	switch name {
	case "caddy_ktls_gateway_dials_resumed_total":
		return false
	case "caddy_ktls_handshakes_total":
		return !strings.Contains(series, `reason="none"`)
	case "caddy_ktls_offload_directions_total":
		return strings.Contains(series, `mode="userspace"`)
	}
	return !strings.Contains(series, `result="ok"`) && !strings.Contains(series, `end="closed"`) && !strings.Contains(series, `outcome="used"`)
}

// hopCounters sums each process's counter changes over r's steps, by
// process name then series; failures only, or every series.
func hopCounters(r *benchjson.LoadResult, failures bool) map[string]map[string]float64 {
	out := map[string]map[string]float64{}
	for _, s := range resultSteps(r) {
		for _, h := range s.Hops {
			for k, v := range h.Counters {
				if failures && !isFailureSeries(k) {
					continue
				}
				if out[h.Name] == nil {
					out[h.Name] = map[string]float64{}
				}
				out[h.Name][k] += v
			}
		}
	}
	return out
}

// hopFailures names the failures a chain's processes counted over r's
// steps, the gateway first ("" for none).
func hopFailures(r *benchjson.LoadResult) string {
	counted := hopCounters(r, true)
	var parts []string
	for _, hop := range hopOrder(r, counted) {
		for _, k := range slices.Sorted(maps.Keys(counted[hop])) {
			parts = append(parts, fmt.Sprintf("%s %s × %.0f", hop, k, counted[hop][k]))
		}
	}
	return strings.Join(parts, "; ")
}

// hopOrder is the processes of counted in r's order (the gateway first).
func hopOrder(r *benchjson.LoadResult, counted map[string]map[string]float64) []string {
	var names []string
	for _, s := range resultSteps(r) {
		for _, h := range s.Hops {
			if _, ok := counted[h.Name]; ok && !slices.Contains(names, h.Name) {
				names = append(names, h.Name)
			}
		}
	}
	return names
}

// gatewayDials are the tunnels a chain's gateway opened over r's steps
// and how many of them resumed their session with the forwarder (its
// caddy_ktls_gateway_dials_total ok and dials_resumed_total).
func gatewayDials(r *benchjson.LoadResult) (ok, resumed float64) {
	for k, v := range hopCounters(r, false)["gateway"] {
		name, _, _ := strings.Cut(k, "{")
		switch {
		case name == "caddy_ktls_gateway_dials_total" && strings.Contains(k, `result="ok"`):
			ok += v
		case name == "caddy_ktls_gateway_dials_resumed_total":
			resumed += v
		}
	}
	return ok, resumed
}

// sweepStep is r's sweep step at pct % of its capacity, or nil.
func sweepStep(r *benchjson.LoadResult, pct float64) *benchjson.Step {
	if i := slices.IndexFunc(r.Steps, func(s benchjson.Step) bool { return s.Pct == pct }); i >= 0 {
		return &r.Steps[i]
	}
	return nil
}

// cpuPerCall is a step's contender CPU per completed call in ms, each
// process's share named for a chain.
func cpuPerCall(s *benchjson.Step) string {
	if s == nil || s.Goodput <= 0 {
		return "–"
	}
	out := fmt.Sprintf("%.1f", s.ContenderCPU/s.Goodput*1000)
	if len(s.Hops) > 1 {
		parts := make([]string, len(s.Hops))
		for i, h := range s.Hops {
			parts[i] = fmt.Sprintf("%s %.1f", h.Name, h.CPU/s.Goodput*1000)
		}
		out += " (" + strings.Join(parts, " + ") + ")"
	}
	return out
}

// sweepErrors are r's failed calls over its sweep, by class.
func sweepErrors(r *benchjson.LoadResult) string {
	total := benchjson.Step{Errors: map[string]int{}}
	for _, s := range r.Steps {
		for k, v := range s.Errors {
			total.Errors[k] += v
		}
	}
	return errorCell(&total)
}

// writeChains writes the section that compares the gateway chains with
// l7-l7 in the same run, shape by shape; nothing without a chain.
func writeChains(b *bytes.Buffer, l *benchjson.LoadReport) {
	var chains []*benchjson.LoadResult
	for _, r := range l.Results {
		if isChain(r) {
			chains = append(chains, r)
		}
	}
	if len(chains) == 0 {
		return
	}
	b.WriteString("\n## The gateway chains against `" + chainBase + "`\n\n")
	b.WriteString("A chain is the user's path through an edge gateway: the generator is the user (TLS 1.3 to the gateway, no client certificate), the contender the gateway Caddy and the hop behind it, both on the contender's CPUs, reaching the one upstream (the sandbox targets of the forwarder rows do not apply). Each figure is set beside `" + chainBase + "`'s in the same shape (× its figure: below 1 is a lower latency, above 1 a higher capacity or goodput). *CPU per call* is the contender's CPU (both processes) per completed call at 100 % of capacity, in ms, each process's share named; *tunnels opened* are the forwarder tunnels the gateway opened over the steps (its `caddy_ktls_gateway_dials_total{result=\"ok\"}`) and how many of them resumed their session with the forwarder; `" + chainBase + "` pools plain TLS connections to its dataplane and counts none.")
	if l.Params.Standby > 0 {
		fmt.Fprintf(b, " `l4-l4-standby`'s gateway keeps %d standby connections.", l.Params.Standby)
	}
	b.WriteString("\n\n| contender | shape | capacity (calls/s) | × | p99 at 50 % (ms) | × | p99.9 at 50 % | p99 at 80 % (ms) | × | p99.9 at 80 % | goodput 200 % / 100 % | errors over the sweep | CPU per call at 100 % (ms) | user TLS | tunnels opened (resumed) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|\n")
	for _, r := range chains {
		bi := slices.IndexFunc(l.Results, func(o *benchjson.LoadResult) bool { return o.Contender == chainBase && o.Shape == r.Shape })
		base := &benchjson.LoadResult{}
		if bi >= 0 {
			base = l.Results[bi]
		}
		p99 := func(r *benchjson.LoadResult, pct float64, tail bool) float64 {
			s := sweepStep(r, pct)
			switch {
			case s == nil:
				return 0
			case tail:
				return s.P999us
			}
			return s.P99us
		}
		ratio := "–"
		if c := goodputCell(sweepStep(r, 100), sweepStep(r, 200), l.CPUs); c != "" {
			ratio = c
		}
		tunnels := "–"
		if ok, resumed := gatewayDials(r); ok > 0 {
			tunnels = fmt.Sprintf("%.0f (%.0f)", ok, resumed)
		}
		fmt.Fprintf(b, "| `%s` | %s | %.0f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", r.Contender, r.Shape, r.Capacity, ratioCell(r.Capacity, base.Capacity),
			ms(p99(r, 50, false)), ratioCell(p99(r, 50, false), p99(base, 50, false)), ms(p99(r, 50, true)),
			ms(p99(r, 80, false)), ratioCell(p99(r, 80, false), p99(base, 80, false)), ms(p99(r, 80, true)),
			ratio, sweepErrors(r), cpuPerCall(sweepStep(r, 100)), userTLSCell(r), tunnels)
	}
}

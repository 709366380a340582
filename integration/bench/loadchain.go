package main

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

// loadHop is one process of a load contender: the forwarder alone, or a
// chain's gateway and the hop behind it; a step records each one's CPU,
// memory and (with an admin endpoint) its counters.
type loadHop struct {
	name string
	pid  int
	// admin: the unix socket of its admin endpoint ("": none).
	admin string
}

// sampleHops samples every hop's CPU.
func sampleHops(hops []loadHop) ([]cpuSample, error) {
	out := make([]cpuSample, len(hops))
	for i, h := range hops {
		s, err := sampleCPU(h.pid)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", h.name, err)
		}
		out[i] = s
	}
	return out, nil
}

// hopCPUs is each hop's CPU in cores between two samples wall seconds
// apart.
func hopCPUs(a, b []cpuSample, wall float64) []float64 {
	out := make([]float64, len(a))
	for i := range a {
		cpu, _, _, _ := cpuUsed(a[i], b[i])
		out[i] = cpu / wall
	}
	return out
}

// scrapeHops reads every hop's counters of benchjson.LoadCounterFamilies
// (nil for a hop without an admin endpoint, or whose endpoint failed:
// its counters are then left out of the step). A one-process contender's
// are not read: a step records counters for a chain's hops only
// (hopStep).
func scrapeHops(hops []loadHop) []map[string]float64 {
	if len(hops) < 2 {
		return nil
	}
	return scrapeHopSeries(hops, benchjson.LoadCounterFamilies)
}

// scrapeHopSeries reads every hop's series of families from its admin
// endpoint's /metrics (nil for a hop without one, or whose endpoint
// failed).
func scrapeHopSeries(hops []loadHop, families []string) []map[string]float64 {
	out := make([]map[string]float64, len(hops))
	for i, h := range hops {
		if h.admin == "" {
			continue
		}
		c, err := scrapeSeries(h.admin, families)
		if err != nil {
			continue
		}
		out[i] = c
	}
	return out
}

// scrapeSeries reads the series of families from the /metrics of the admin
// endpoint on sock.
func scrapeSeries(sock string, families []string) (map[string]float64, error) {
	client := adminClient(sock)
	client.Timeout = 10 * time.Second
	resp, err := client.Get("http://localhost/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics: %s", resp.Status)
	}
	return parseCounters(body, families), nil
}

// parseCounters reads the series of families from Prometheus's text
// format: each sample line "name{labels} value", keyed by "name{labels}".
func parseCounters(text []byte, families []string) map[string]float64 {
	out := map[string]float64{}
	for line := range strings.SplitSeq(string(text), "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		series := line[:i]
		name, _, _ := strings.Cut(series, "{")
		if !slices.Contains(families, name) {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[series] = v
		}
	}
	return out
}

// counterDelta is the change of every series from before to after that
// changed (a series new in after counts from 0); nil when none did, or
// when either scrape is missing.
func counterDelta(before, after map[string]float64) map[string]float64 {
	if before == nil || after == nil {
		return nil
	}
	var out map[string]float64
	for k, v := range after {
		if d := v - before[k]; d != 0 {
			if out == nil {
				out = map[string]float64{}
			}
			out[k] = d
		}
	}
	return out
}

// hopStep is what a step records of its contender's processes: their CPU
// (cores), resident memory and fds summed into the step's contender
// figures, and for a chain each hop's figures and counter changes
// (Step.Hops; one process has none, as before chains were driven).
func hopStep(s *benchjson.Step, hops []loadHop, cpus []float64, before, after []map[string]float64) {
	chain := len(hops) > 1
	var sum float64
	for i, h := range hops {
		rss, fds := procMemory(h.pid)
		s.ContenderRSS += rss
		s.ContenderFDs += fds
		if cpus != nil {
			sum += cpus[i]
		}
		if !chain {
			continue
		}
		hs := benchjson.Hop{Name: h.name, RSS: rss, FDs: fds}
		if cpus != nil {
			hs.CPU = round(cpus[i], 2)
		}
		if before != nil && after != nil {
			hs.Counters = counterDelta(before[i], after[i])
		}
		s.Hops = append(s.Hops, hs)
	}
	if cpus != nil {
		s.ContenderCPU = round(sum, 2)
	}
}

// hopsBefore is the contender's processes' resident memory and fds before
// a shape: their sums, and for a chain each one's.
func hopsBefore(hops []loadHop) (rss int64, fds int, each []benchjson.Hop) {
	for _, h := range hops {
		r, f := procMemory(h.pid)
		rss += r
		fds += f
		if len(hops) > 1 {
			each = append(each, benchjson.Hop{Name: h.name, RSS: r, FDs: f})
		}
	}
	return rss, fds, each
}

// classifyChain names a failed call through a chain: as classify does, but
// every answer the user connection got came from the gateway, whose
// peer-side failures (a refusal, a reset, a close, an alert, an HTTP
// status) the cause names as the gateway's, and whose HTTP 502 is its own
// answer for a failure behind it (ClassGateway), not the target's; the
// generator's own deadline and wrong bytes stay as they are.
func classifyChain(err error) (class, cause string) {
	class, cause = classify(err)
	switch class {
	case benchjson.ClassTimeout, benchjson.ClassCorrupt:
		return class, cause
	case benchjson.ClassTarget:
		class = benchjson.ClassGateway
	}
	return class, "gateway: " + cause
}

// gatewayOKDials is how many tunnels a chain's gateway (hops[0]) opened
// between two scrapes: the change of its caddy_ktls_gateway_dials_total
// series with result ok; counted is false where the gateway has no such
// series (l7-l7's reverse_proxy) or a scrape is missing.
func gatewayOKDials(before, after []map[string]float64) (n int64, counted bool) {
	if len(before) == 0 || len(after) == 0 || before[0] == nil || after[0] == nil {
		return 0, false
	}
	return seriesDelta(before[0], after[0], func(name, series string) bool {
		return name == "caddy_ktls_gateway_dials_total" && strings.Contains(series, `result="ok"`)
	})
}

// chainTunnels is how many tunnels a chain's gateway opened between two
// scrapes: its ok dials (gatewayOKDials), and of them those the
// key-install check counts (checked): no more than its completed
// handshakes with the hop behind it (gatewayDialHandshakes). ok is false
// where the gateway counts no dials (l7-l7's reverse_proxy).
func chainTunnels(before, after []map[string]float64) (dials, checked int64, ok bool) {
	dials, ok = gatewayOKDials(before, after)
	if !ok {
		return 0, 0, false
	}
	checked = dials
	if h, ok := gatewayDialHandshakes(before, after); ok {
		checked = min(dials, h)
	}
	return dials, checked, true
}

// gatewayDialHandshakes is how many TLS handshakes with the hop behind a
// chain's gateway (hops[0]) completed between two scrapes: the change of
// its caddy_ktls_handshakes_total, every reason but handshake-failed, for
// each module that counts dials (caddy_ktls_gateway_dials_total). A
// tunnel's keys are installed at its handshake, while the gateway counts
// its dial ok later where it cannot tell sooner: an L7 gateway's pool
// reports a tunnel open at its first byte or its close, and the HTTP
// transport dials tunnels it leaves idle. Such a tunnel's ok dial can fall
// in a later shape than its key installs. counted is false where the
// gateway has no dial counters or a scrape is missing.
func gatewayDialHandshakes(before, after []map[string]float64) (n int64, counted bool) {
	if len(before) == 0 || len(after) == 0 || before[0] == nil || after[0] == nil {
		return 0, false
	}
	dialers := map[string]bool{}
	for k := range after[0] {
		if name, labels, _ := strings.Cut(k, "{"); name == "caddy_ktls_gateway_dials_total" {
			dialers[moduleLabel(labels)] = true
		}
	}
	if len(dialers) == 0 {
		return 0, false
	}
	n, _ = seriesDelta(before[0], after[0], func(name, series string) bool {
		_, labels, _ := strings.Cut(series, "{")
		return name == "caddy_ktls_handshakes_total" && dialers[moduleLabel(labels)] && !strings.Contains(labels, `reason="handshake-failed"`)
	})
	return n, true
}

// moduleLabel is the module label's value in a series' labels.
func moduleLabel(labels string) string {
	_, v, ok := strings.Cut(labels, `module="`)
	if !ok {
		return ""
	}
	v, _, _ = strings.Cut(v, `"`)
	return v
}

// ulpFallbacks is how many sockets the chain's processes served in
// userspace because TCP_ULP failed on them between two scrapes (their
// caddy_ktls_handshakes_total{reason="setsockopt-ulp"}): on a kernel with
// kTLS that is a socket no longer established, whose peer left after the
// handshake (a user at its deadline, a gateway giving up on a tunnel), and
// which installs no key.
func ulpFallbacks(before, after []map[string]float64) int64 {
	var n int64
	for i := range min(len(before), len(after)) {
		if before[i] == nil || after[i] == nil {
			continue
		}
		d, _ := seriesDelta(before[i], after[i], func(name, series string) bool {
			return name == "caddy_ktls_handshakes_total" && strings.Contains(series, `reason="setsockopt-ulp"`)
		})
		n += d
	}
	return n
}

// failedBehind is how many handshakes the processes behind a chain's
// gateway (every hop but the first) failed between two scrapes for a cause
// other than shedding: their caddy_ktls_handshake_failures_total without
// reason="overloaded". A shed connection never completes the gateway's
// handshake, so it is no tunnel the gateway counted; a handshake the
// gateway completed and then gave up on (its user gone), or one the
// forwarder's handshake_timeout ended, may be, and its socket installs no
// key.
func failedBehind(before, after []map[string]float64) int64 {
	var n int64
	for i := 1; i < min(len(before), len(after)); i++ {
		if before[i] == nil || after[i] == nil {
			continue
		}
		d, _ := seriesDelta(before[i], after[i], func(name, series string) bool {
			return name == "caddy_ktls_handshake_failures_total" && !strings.Contains(series, `reason="overloaded"`)
		})
		n += d
	}
	return n
}

// seriesDelta sums the change of the series that match from before to
// after; found says whether after has any.
func seriesDelta(before, after map[string]float64, match func(name, series string) bool) (n int64, found bool) {
	for k, v := range after {
		name, _, _ := strings.Cut(k, "{")
		if match(name, k) {
			n += int64(v - before[k])
			found = true
		}
	}
	return n, found
}

// chainOpenParallel is how many of a chain's tunnels open at a time: each
// is two TLS handshakes (l7-l7 and l7-l4: one, and their gateway's
// dials) on the contender's CPU, where a one-process contender does one.
const chainOpenParallel = 16

// goMemoryFamilies are the Go runtime's memory gauges a Caddy hop's
// /metrics carries.
var goMemoryFamilies = []string{"go_memstats_heap_alloc_bytes", "go_memstats_heap_inuse_bytes", "go_memstats_stack_inuse_bytes", "go_goroutines"}

// scrapeGoMemory reads each hop's goMemoryFamilies (nil for a hop without
// an admin endpoint, or whose endpoint failed), each right after a garbage
// collection (the admin endpoint's /debug/pprof/heap?gc=1), so that the
// heap's figures are what is live, not what the next cycle would free.
func scrapeGoMemory(hops []loadHop) []map[string]float64 {
	for _, h := range hops {
		if h.admin == "" {
			continue
		}
		client := adminClient(h.admin)
		client.Timeout = 30 * time.Second
		if resp, err := client.Get("http://localhost/debug/pprof/heap?gc=1"); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}
	return scrapeHopSeries(hops, goMemoryFamilies)
}

// goMemory returns, and logs, per hop with an admin endpoint, what the Go
// runtime holds per tunnel once the shape's tunnels are open (after −
// before, over tunnels, each after a collection): the live heap, the
// heap's spans in use and the goroutine stacks, which with the runtime's
// own overhead and the heap's growth room make up the resident memory the
// report gives.
func goMemory(hops []loadHop, before, after []map[string]float64, tunnels int, shape string) []benchjson.GoMemory {
	if shape != "reuse" || tunnels <= 0 {
		return nil
	}
	var out []benchjson.GoMemory
	for i, h := range hops {
		if before[i] == nil || after[i] == nil {
			continue
		}
		per := func(name string) float64 { return (after[i][name] - before[i][name]) / float64(tunnels) }
		m := benchjson.GoMemory{Name: h.name, HeapLive: per("go_memstats_heap_alloc_bytes"), HeapInuse: per("go_memstats_heap_inuse_bytes"),
			Stacks: per("go_memstats_stack_inuse_bytes"), Goroutines: per("go_goroutines")}
		log.Printf("   %s, Go runtime per tunnel after opening %d: live heap %.1f KiB, heap in use %.1f KiB, stacks %.1f KiB, goroutines %.2f",
			h.name, tunnels, m.HeapLive/1024, m.HeapInuse/1024, m.Stacks/1024, m.Goroutines)
		out = append(out, m)
	}
	return out
}

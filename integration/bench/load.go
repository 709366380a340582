package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"net/netip"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// loadContenders are the contenders a load run can drive: the forwarder and
// the peers, each verifying the gateway's client certificate. ktls-off is
// the forwarder in userspace TLS: its shedding and its handshakes are the
// forwarder's own, on a kernel without kTLS too.
var loadContenders = []string{"ktls", "ktls-off", "l4-proxy", "reverse-proxy", "haproxy", "nginx"}

// loadChains are the edge-gateway chains a load run can drive besides
// (named in -contenders; not run by default): the user's connection goes to
// a gateway Caddy, which reaches the app through the hop behind it, and
// l4-l4-standby is l4-l4 whose gateway keeps -standby standby connections.
var loadChains = []string{"l7-l7", "l7-l4", "l4-l4", ttfbStandby}

var loadShapes = []string{"reuse", "per-call"}

func runLoad(args []string) error {
	fs := flag.NewFlagSet("load", flag.ExitOnError)
	p := benchjson.LoadParams{PeersMTLS: true}
	only := fs.String("contenders", strings.Join(loadContenders, ","), "contenders to drive: "+strings.Join(loadContenders, ", ")+", and the gateway chains "+strings.Join(loadChains, ", "))
	fs.IntVar(&p.Standby, "standby", 4, "the gateway's standby option in "+ttfbStandby)
	shapeList := fs.String("shapes", strings.Join(loadShapes, ","), "shapes: reuse (calls on a fixed set of long-lived tunnels) and per-call (a resumed connection per call)")
	fs.IntVar(&p.Tunnels, "tunnels", 10000, "reuse: tunnels; per-call: connections in flight at most (either: the generator's slots)")
	fs.IntVar(&p.Targets, "targets", 1000, "sandbox targets behind the forwarder (127.1.x.y on one upstream)")
	fs.IntVar(&p.Req, "req", 1024, "request bytes per call")
	fs.IntVar(&p.Resp, "resp", 4096, "response bytes per call")
	fs.Float64Var(&p.StepSeconds, "step", 10, "seconds per rate step")
	fs.Float64Var(&p.UnloadedRate, "unloaded-rate", 20, "calls/s of the unloaded step")
	fs.Float64Var(&p.UnloadedSeconds, "unloaded-step", 20, "seconds of the unloaded step")
	rates := fs.String("rates", "", "fixed rates (calls/s, comma-separated) instead of the capacity search and sweep")
	pcts := fs.String("sweep", "25,50,80,100,150,200", "sweep rates in % of each contender's capacity")
	fs.Float64Var(&p.MaxRate, "max-rate", 20000, "the capacity search's highest rate")
	fs.IntVar(&p.SearchSteps, "search-steps", 4, "bisection steps of the capacity search after its doubling")
	fs.Float64Var(&p.P99Factor, "p99-factor", 10, "capacity: p99 at most this many times the unloaded p99")
	timeout := fs.Duration("call-timeout", 5*time.Second, "the generator's own deadline per call, from its scheduled arrival")
	fs.Uint64Var(&p.Seed, "seed", 1, "seed of the arrival schedules")
	fs.IntVar(&p.Bulk, "bulk", 0, "bulk tunnels streaming through the fairness step (0: no fairness step)")
	fs.Int64Var(&p.BulkBytes, "bulk-bytes", 16<<20, "bytes per bulk transfer")
	fs.Float64Var(&p.FairnessPct, "fairness-pct", 50, "the fairness step's rate in % of capacity")
	fs.IntVar(&p.MaxHandshakes, "max-handshakes", 0, "the forwarder's max_handshakes, and an l4-l4 gateway's (0: its default, 128 per CPU it may use; -1: no bound)")
	fs.StringVar(&p.MaxSchedulingDelay, "max-scheduling-delay", "", "the forwarder's max_scheduling_delay, and an l4-l4 gateway's, a Go duration (empty: none)")
	fs.StringVar(&p.PinContender, "pin-contender", "", "CPU list the contender runs on (taskset -c); run the generator itself on the others")
	strict := fs.Bool("strict", false, "fail on any failed call, generator-saturated arrival or bulk error (the smoke run, at rates far below capacity); without it only a wrong byte fails the run")
	mode := fs.String("mode", "vm", "where this runs, recorded: vm (real time, no icount) or native")
	label := fs.String("label", "", "a label for the report (e.g. reduced)")
	caddyBin := fs.String("caddy", "bin/caddy", "Caddy binary with caddy-l4 and this module")
	out := fs.String("out", "load.json", "JSON output file")
	commit := fs.String("commit", "", "the commit measured (bench.sh passes it)")
	fs.Parse(args)
	p.CallTimeoutMs = timeout.Milliseconds()
	p.Shapes = strings.Split(*shapeList, ",")
	for _, s := range p.Shapes {
		if !slices.Contains(loadShapes, s) {
			return fmt.Errorf("unknown shape %q (have %s)", s, strings.Join(loadShapes, ", "))
		}
	}
	if p.Tunnels < 1 || p.Targets < 1 || p.Req < 1 || p.Resp < 1 || p.Req > maxCallLen || p.Resp > maxCallLen || p.StepSeconds <= 0 || p.UnloadedRate <= 0 {
		return errors.New("sizes and rates must be positive (calls at most 1 MiB)")
	}
	var err error
	if p.Rates, err = floats(*rates); err != nil {
		return err
	}
	if p.SweepPcts, err = floats(*pcts); err != nil {
		return err
	}
	if len(p.Rates) > 0 {
		p.SweepPcts = nil
	}
	h, err := newHarness(*caddyBin, "ktls-load-")
	if err != nil {
		return err
	}
	defer h.close()
	// The targets' listener: the wildcard address, so every 127.1.x.y
	// reaches it.
	loadAddr := "127.0.0.1:0"
	if p.Targets > 1 {
		loadAddr = "0.0.0.0:0"
	}
	lu, err := net.Listen("tcp", loadAddr)
	if err != nil {
		return err
	}
	defer lu.Close()
	go serveLoad(lu)
	targets := loadTargets(p.Targets, uint16(lu.Addr().(*net.TCPAddr).Port))

	names := strings.Split(*only, ",")
	if !slices.Contains(names, ttfbStandby) {
		p.Standby = 0 // no gateway keeps standby connections
	}
	rep := &benchjson.LoadReport{Header: newHeader(benchjson.LoadKind, benchjson.LoadSchema, *mode, *label, *commit),
		Params: p, Notes: loadNotes(p), OK: true}
	if slices.ContainsFunc(names, func(n string) bool { return slices.Contains(loadChains, n) }) {
		rep.Notes = append(rep.Notes, loadChainNote)
	}
	kernelTLS := kerneltest.Available()
	for _, name := range names {
		c, ok := findContender(strings.TrimSuffix(name, "-standby"))
		if !ok || !slices.Contains(loadContenders, name) && !slices.Contains(loadChains, name) {
			return fmt.Errorf("unknown load contender %q (have %s, %s)", name, strings.Join(loadContenders, ", "), strings.Join(loadChains, ", "))
		}
		if (c.kernelTX || c.kernelRX) && kernelTLS != nil {
			reason := fmt.Sprintf("this kernel has no kTLS (%v)", kernelTLS)
			log.Printf("REFUSED %s: %s", name, reason)
			rep.Skipped = append(rep.Skipped, benchjson.Skipped{Contender: name, Reason: reason})
			continue
		}
		env := &runEnv{dir: h.dir, caddy: h.caddy, self: h.self, listen: freeAddr(), up: h.up, pki: h.pki, peersMTLS: p.PeersMTLS,
			allowCIDRs: []string{"127.0.0.0/8"}, maxConns: 2*p.Tunnels + 64, maxHandshakes: p.MaxHandshakes,
			maxSchedulingDelay: p.MaxSchedulingDelay, hopAdmin: true}
		if c.chain != nil {
			env.hopListen = freeAddr()
			if name == ttfbStandby {
				env.gatewayStandby = p.Standby
			}
		}
		results, err := loadContender(name, c, env, p, targets, *timeout, *strict)
		rep.Results = append(rep.Results, results...)
		if err != nil {
			log.Printf("FAIL %s: %v", name, err)
			rep.OK = false
		}
		for _, r := range results {
			if len(r.Errors) > 0 {
				rep.OK = false
			}
		}
	}
	return writeReport(*out, rep, rep.OK, "bench load", len(rep.Results), "see the errors in "+*out)
}

// serveLoad serves the header protocol on the targets' listener; its
// failures are the targets' own, and show at the gateway as closed tunnels.
func serveLoad(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			serveRaw(c)
		}()
	}
}

// floats parses a comma-separated list of numbers ("" is none).
func floats(s string) ([]float64, error) {
	var out []float64
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		v, err := strconv.ParseFloat(f, 64)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("%q: want positive numbers", s)
		}
		out = append(out, v)
	}
	return out, nil
}

// pinned wraps a contender's command in taskset -c cpus.
func pinned(cmd *exec.Cmd, cpus string) *exec.Cmd {
	if cpus == "" {
		return cmd
	}
	args := append([]string{"-c", cpus, cmd.Path}, cmd.Args[1:]...)
	p := exec.Command("taskset", args...)
	p.Env, p.Dir = cmd.Env, cmd.Dir
	return p
}

// loadContender starts c (named name: a chain with standby connections
// is l4-l4's contender under another name), every process pinned to the
// contender's CPUs, and drives every shape through it.
func loadContender(name string, c contender, env *runEnv, p benchjson.LoadParams, targets []netip.AddrPort, timeout time.Duration, strict bool) ([]*benchjson.LoadResult, error) {
	hopList, err := c.hops(env)
	if err != nil {
		return nil, err
	}
	procs, stop, err := startChain(name, hopList, env.dir, p.PinContender, "load")
	if err != nil {
		return nil, err
	}
	defer stop()
	// startChain started them back to front: the gateway first here.
	slices.Reverse(procs)
	hops := make([]loadHop, len(procs))
	for i, proc := range procs {
		hops[i] = loadHop{name: proc.name, pid: proc.cmd.Process.Pid, admin: hopList[i].admin}
		if _, err := os.Stat(hops[i].admin); err != nil {
			// Not a Caddy (contender.hops names a socket for every
			// one-process contender): no admin endpoint to read.
			hops[i].admin = ""
		}
	}
	logs := func() string {
		var b strings.Builder
		for _, proc := range procs {
			fmt.Fprintf(&b, "the %s's log ends:\n%s", proc.name, tail(proc.log))
		}
		return b.String()
	}
	log.Printf("== load %s (%s)", name, hopPids(hops))
	var results []*benchjson.LoadResult
	for _, shape := range p.Shapes {
		r := &benchjson.LoadResult{Contender: name, Shape: shape}
		results = append(results, r)
		// The shape before may have left work in flight: its tunnels
		// would count here, their key installs in its window.
		if settled := settleHops(context.Background(), hops, time.Minute); settled > time.Second {
			log.Printf("   %s %s: waited %.1f s for the contender to settle", name, shape, settled.Seconds())
		}
		stat0, statErr := kerneltest.ReadStat()
		conns0, counters0 := env.up.conns.Load(), scrapeHops(hops)
		g := c.gateway(env, shape == "per-call")
		var dials []func(context.Context) (net.Conn, error)
		var tr *http.Transport
		switch {
		case c.dialKind == "preamble":
			for _, t := range targets {
				dials = append(dials, g.counted(g.preambleDialer(env.listen, env.pki.signer, t)))
			}
		case c.dialKind == "https":
			tr = &http.Transport{TLSClientConfig: g.tls, MaxIdleConnsPerHost: p.Tunnels, MaxConnsPerHost: p.Tunnels,
				DisableKeepAlives: shape == "per-call", DisableCompression: true}
		default:
			dials = []func(context.Context) (net.Conn, error){g.dial}
		}
		gen := newLoadGen(shape == "reuse", p.Tunnels, dials, g.base, tr, g.tls.ServerName, p.Req, p.Resp, timeout)
		gen.hops = hops
		if c.chain != nil {
			gen.classify = classifyChain
		}
		ctx := context.Background()
		r.RSSBefore, r.FDsBefore, r.HopsBefore = hopsBefore(hops)
		goBefore := scrapeGoMemory(hops)
		parallel := 64
		if c.chain != nil {
			parallel = chainOpenParallel
		}
		if err := gen.open(ctx, parallel); err != nil {
			// What the contender said of it: the refusals' reasons.
			r.Errors = append(r.Errors, "opening: "+err.Error(), logs())
			gen.close()
			continue
		}
		r.GoMemory = goMemory(hops, goBefore, scrapeGoMemory(hops), p.Tunnels, shape)
		runLoadShape(ctx, gen, c, env, p, r)
		r.Errors = append(r.Errors, stepErrors(r, strict)...)
		if err := gen.close(); err != nil {
			r.Errors = append(r.Errors, "closing the tunnels: "+err.Error())
		}
		// Past capacity a hop is still taking on what the gateway dialed
		// (a forwarder's key install trails the gateway's ok dial): the
		// shape's tallies below are read once the chain is idle.
		if settled := settleHops(ctx, hops, time.Minute); settled > time.Second {
			log.Printf("   %s %s: waited %.1f s after the shape for the contender to settle", name, shape, settled.Seconds())
		}
		r.Tunnels, r.Established = g.tunnels.Load(), gen.established.Load()
		r.Handshakes, r.Resumed = g.tunnels.Load()+gen.handshakes.Load(), g.resumed.Load()+gen.resumed.Load()
		res := &result{Tunnels: gen.established.Load()}
		if c.chain != nil {
			r.UpstreamConns = env.up.conns.Load() - conns0
			res.UpstreamConns = r.UpstreamConns
			counters1 := scrapeHops(hops)
			if n, checked, ok := chainTunnels(counters0, counters1); ok {
				r.GatewayTunnels, res.UpstreamConns = n, checked
			}
			r.ULPFallbacks = ulpFallbacks(counters0, counters1)
			r.FailedBehind = failedBehind(counters0, counters1)
			for i, h := range hops {
				if i < len(counters0) && i < len(counters1) && counters0[i] != nil && counters1[i] != nil {
					r.ShapeCounters = append(r.ShapeCounters, benchjson.Hop{Name: h.name, Counters: counterDelta(counters0[i], counters1[i])})
				}
			}
			res.keyless = r.ULPFallbacks + r.FailedBehind
		}
		if statErr == nil {
			stat1, _ := kerneltest.ReadStat()
			r.TLSStat = stat1.Sub(stat0)
			// Under overload the gateway gives up on tunnels the
			// contender never took on (no key install): the tunnels
			// required to have installed keys are those with a
			// completed call (a chain's: those its gateway opened).
			res.TLSStat = r.TLSStat
			r.Offload = offloadOf(res, c)
			r.Errors = append(r.Errors, res.Errors...)
		} else {
			r.Offload = "userspace (this kernel has no /proc/net/tls_stat)"
		}
		// A chain's user is not authenticated: only the gateway's hop
		// behind it asks for a certificate.
		if c.chain == nil && g.certAsked.Load() == 0 {
			r.Errors = append(r.Errors, "mtls: the server never asked the gateway for its certificate")
		}
		for _, e := range r.Errors {
			log.Printf("FAIL %s %s: %s", name, shape, e)
		}
	}
	return results, nil
}

// hopPids names each process of a contender with its pid, for the log.
func hopPids(hops []loadHop) string {
	parts := make([]string, len(hops))
	for i, h := range hops {
		parts[i] = fmt.Sprintf("%s pid %d", h.name, h.pid)
	}
	return strings.Join(parts, ", ")
}

// runLoadShape runs the unloaded step, then the fixed rates or the capacity
// search and the sweep, then the fairness steps.
func runLoadShape(ctx context.Context, gen *loadGen, c contender, env *runEnv, p benchjson.LoadParams, r *benchjson.LoadResult) {
	seed := p.Seed
	// before, when not nil, runs once the contender is idle, just before
	// the step (the fairness step's bulk tunnels start there).
	var before func()
	step := func(rate, secs float64) benchjson.Step {
		seed++
		settled := gen.settle(ctx, time.Minute)
		if before != nil {
			before()
		}
		s := gen.step(ctx, rate, time.Duration(secs*float64(time.Second)), seed)
		s.SettleSeconds = round(settled.Seconds(), 1)
		log.Printf("   %s %s %.0f/s: offered %d, completed %d, saturated %d, errors %v, goodput %.1f/s, p50 %.0f p99 %.0f p99.9 %.0f max %.0f µs, lag p99 %.0f µs, generator %.2f cores, contender %.2f cores, rss %d MiB, fds %d",
			c.name, r.Shape, rate, s.Offered, s.Completed, s.Saturated, s.Causes, s.Goodput, s.P50us, s.P99us, s.P999us, s.MaxUs, s.LagP99us, s.GenCPU, s.ContenderCPU, s.ContenderRSS>>20, s.ContenderFDs)
		return s
	}
	fairRate := 0.0
	if len(p.Rates) > 0 {
		for _, rate := range p.Rates {
			r.Steps = append(r.Steps, step(rate, p.StepSeconds))
		}
		fairRate = p.Rates[0]
		if len(r.Steps) > 0 {
			r.Baseline = &r.Steps[0]
		}
	} else {
		u := step(p.UnloadedRate, p.UnloadedSeconds)
		r.Unloaded = &u
		if u.ErrorCount() > 0 || u.Saturated > 0 || u.Completed == 0 {
			r.Errors = append(r.Errors, fmt.Sprintf("unloaded step: %d errors, %d saturated, %d completed (%s)", u.ErrorCount(), u.Saturated, u.Completed, u.FirstError))
			return
		}
		bound := p.P99Factor * u.P99us
		ok := func(s benchjson.Step) bool { return s.ErrorCount() == 0 && s.Saturated == 0 && s.P99us <= bound }
		good, bad := p.UnloadedRate, 0.0
		for rate := 2 * p.UnloadedRate; rate <= p.MaxRate; rate *= 2 {
			s := step(rate, p.StepSeconds)
			r.Search = append(r.Search, s)
			if !ok(s) {
				bad = rate
				break
			}
			good = rate
		}
		for i := 0; i < p.SearchSteps && bad > 0; i++ {
			mid := (good + bad) / 2
			s := step(mid, p.StepSeconds)
			r.Search = append(r.Search, s)
			if ok(s) {
				good = mid
			} else {
				bad = mid
			}
		}
		r.Capacity = round(good, 1)
		var at100, at200 float64
		for _, pct := range p.SweepPcts {
			s := step(r.Capacity*pct/100, p.StepSeconds)
			s.Pct = pct
			r.Steps = append(r.Steps, s)
			switch pct {
			case 100:
				at100 = s.Goodput
			case 200:
				at200 = s.Goodput
			}
			if pct == p.FairnessPct {
				r.Baseline = &r.Steps[len(r.Steps)-1]
			}
		}
		if at100 > 0 && at200 > 0 {
			r.GoodputRatio = round(at200/at100, 3)
		}
		fairRate = r.Capacity * p.FairnessPct / 100
	}
	if p.Bulk > 0 && fairRate > 0 {
		bulkCtx, stop := context.WithCancel(ctx)
		bg := c.gateway(env, false)
		done := make(chan bulkTally, p.Bulk)
		before = func() {
			for i := range p.Bulk {
				go func() { done <- bulkLoop(bulkCtx, bg, i%2 == 0, p.BulkBytes) }()
			}
		}
		s := step(fairRate, p.StepSeconds)
		stop()
		s.Bulk = p.Bulk
		for range p.Bulk {
			t := <-done
			s.BulkBytes += t.bytes
			s.BulkErrors += t.errors
		}
		if r.Baseline != nil {
			s.Pct = r.Baseline.Pct
		}
		r.Fairness = &s
	}
}

// stepErrors are a result's failures: a wrong byte in any step (never
// a success, whatever the load), and with strict any failed call,
// saturated arrival or bulk error.
func stepErrors(r *benchjson.LoadResult, strict bool) []string {
	steps := append(append([]benchjson.Step{}, r.Search...), r.Steps...)
	if r.Unloaded != nil {
		steps = append(steps, *r.Unloaded)
	}
	if r.Fairness != nil {
		steps = append(steps, *r.Fairness)
	}
	var errs []string
	for _, s := range steps {
		switch {
		case s.Errors[benchjson.ClassCorrupt] > 0:
			errs = append(errs, fmt.Sprintf("%.0f/s: %d calls answered wrong bytes", s.Rate, s.Errors[benchjson.ClassCorrupt]))
		case strict && (s.ErrorCount() > 0 || s.Saturated > 0 || s.BulkErrors > 0):
			errs = append(errs, fmt.Sprintf("%.0f/s (strict): errors %v, %d generator-saturated, %d bulk errors; first: %s", s.Rate, s.Causes, s.Saturated, s.BulkErrors, s.FirstError))
		}
	}
	return errs
}

// bulkTally is what one bulk tunnel loop moved.
type bulkTally struct {
	bytes  int64
	errors int
}

// bulkLoop streams n-byte downloads (or uploads) one after the other
// until ctx ends; a transfer cut by that end is not counted.
func bulkLoop(ctx context.Context, g *gateway, download bool, n int64) bulkTally {
	var t bulkTally
	for ctx.Err() == nil {
		var err error
		if download {
			_, err = g.download(ctx, n)
		} else {
			_, err = g.upload(ctx, n)
		}
		switch {
		case ctx.Err() != nil:
		case err != nil:
			t.errors++
		default:
			t.bytes += n
		}
	}
	return t
}

// loadNotes describe the method, recorded in the JSON and rendered.
func loadNotes(p benchjson.LoadParams) []string {
	return []string{
		"open loop: calls arrive as a Poisson process at the offered rate (seeded, so a seed gives the same schedule); each call's latency runs from its scheduled arrival to its verified response, so time a call spent waiting behind a slow contender or a late generator counts (no coordinated omission).",
		"slots: reuse runs its calls on a fixed set of tunnels opened (with one uncounted call each) before any step, one call at a time per tunnel; per-call opens a connection per call whose TLS session resumes (the gateway's session cache is filled by one uncounted call first), with at most params.tunnels connections in flight. An arrival that finds no free slot is generator_saturated: not started, not the contender's error.",
		"errors by class: refused (a TLS alert in the handshake, access_denied there or on the first read after the preamble being the forwarder's overload shedding; the peer closing before the handshake; a refused connection; HTTP 503), target (HTTP 502: the upstream's failure), timeout (the generator's own deadline per call, params.call_timeout_ms; a proxy-side timeout shows as a close or alert), reset (ECONNRESET/EPIPE), corrupt (a response byte that differs from the payload: never counted as completed), other.",
		"capacity: the highest offered rate whose p99 is at most params.p99_factor × the unloaded p99, with no error and no saturated arrival; found by doubling from the unloaded rate, then bisecting. The sweep offers fixed shares of each contender's own capacity; goodput_ratio is goodput at 200 % over goodput at 100 %.",
		"latencies come from an HDR-style log-linear histogram (exact below 256 ns, 128 buckets per power of two above, ≤ 0.8 % relative error up to 60 s); a percentile is its bucket's upper bound.",
		"every contender verifies the gateway's client certificate (mutual TLS); ktls also verifies a signed preamble per tunnel and reaches params.targets sandbox targets (127.1.x.y, one upstream on the wildcard address); the peers forward to their one configured upstream.",
	}
}

// loadChainNote is the load report's note on the gateway chains.
const loadChainNote = "chains (l7-l7, l7-l4, l4-l4, l4-l4-standby): the generator is the user, as in the closed-loop gateway bench (gateway.md): TLS 1.3 to the gateway with the pinned suite, no client certificate, no preamble; HTTP/1.1 to the L7 gateways, the raw header protocol to l4-l4's. The contender is two Caddy processes, both pinned to the contender's CPUs: the gateway and the hop behind it (this project's forwarder for l7-l4 and l4-l4, a dataplane reverse_proxy for l7-l7), which reach the one upstream (params.targets does not apply). reuse keeps params.tunnels user connections open; per-call opens a user connection per call with a session cache, so its handshake with the gateway resumes where the gateway issues tickets (user_handshakes and user_resumed count them); behind it, an L7 gateway pools its connections to the hop behind, l4-l4 opens a tunnel per user connection (its mutual TLS with the forwarder resumed by default), and l4-l4-standby takes a standby connection when it has one. Each step records every hop's CPU, resident memory and fds (hops; contender_cpu, contender_rss_bytes and contender_fds are their sums) and the change of each hop's failure counters (hops[].counters, read from its admin endpoint's /metrics): the forwarder's shedding (caddy_ktls_handshake_failures_total{reason=\"overloaded\"}, caddy_ktls_sandbox_rejects_total) and the gateway's dials that failed (caddy_ktls_gateway_dials_total by result: overloaded is the forwarder's shedding as the gateway saw it). Every answer the user gets comes from the gateway: a chain's failed call is classed as the gateway's (cause \"gateway: ...\"; its HTTP 502, an answer for a failure behind it, has the class gateway), and the counters say whose failure it was. The key-install check counts a chain's tunnels as its gateway's ok dials (gateway_tunnels; at the upstream, upstream_conns, where the gateway counts none: l7-l7), or its completed handshakes with the hop behind it where those are fewer (a tunnel dialed in an earlier shape and counted ok in this one, as an L7 gateway's pool does with a tunnel its HTTP transport left idle, installed its keys in that shape), and wants keySockets installs per tunnel in each kernel direction: l4-l4 3, l7-l4 2, l7-l7 none. A socket served in userspace because TCP_ULP failed on it (its peer had left after the handshake, under overload: ulp_fallback_sockets, from the hops' caddy_ktls_handshakes_total{reason=\"setsockopt-ulp\"}) installs no key and counts as installed, as does a handshake the hops behind the gateway failed other than by shedding (failed_behind, their caddy_ktls_handshake_failures_total without reason=\"overloaded\": past capacity the gateway can count a tunnel whose forwarder's handshake then ended, its user gone or its handshake_timeout past; that socket carried nothing). Each shape's tallies are read once the chain has settled after it (shape_counters: each process's counters over the shape). A chain's reuse tunnels open 16 at a time (a one-process contender's 64)."

package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
)

// ttfbStandby is l4-l4 with the gateway's standby option (-standby).
const ttfbStandby = "l4-l4-standby"

// ttfbContenders are the chains a ttfb run can start: the edge-gateway
// paths of issue 19 (a gateway Caddy and the forwarder hop behind it), and
// l4-l4 with standby connections.
var ttfbContenders = []string{"l7-l7", "l7-l4", "l4-l4", ttfbStandby}

// runTTFB measures a new connection's time to first byte through the
// gateway chains with netem delaying the gateway↔forwarder path (issue
// 34): per contender and RTT, connections one after the other, each from
// its connect's start to the first byte of its call's response.
//
// The delay sits on that path alone. The forwarder hop listens on an
// address of its own (-forwarder-addr, 127.0.0.2 by default), and every
// other socket of the run is on 127.0.0.1: the client's to the gateway,
// the forwarder's to the upstream (its route's source address is
// 127.0.0.1), the upstream's. A prio qdisc on the loopback device sends
// every packet to or from that one address to a band with netem on it, and
// the rest to a band without (netemCommands). On loopback each packet
// passes the device's egress qdisc once, so half the RTT each way makes
// the path's round trip the RTT asked. Matching the address, not the
// forwarder's port, makes the path check's TCP probe (a listener of this
// process on the same address) cross the very filter the tunnels do; after
// each measurement every established socket on that address must be one of
// a forwarder's listener's (checkForwarderSockets): a connection from
// that address elsewhere would be delayed too.
//
// Every chain runs at once, each forwarder on a port of its own, and the
// measured connections go to the chains in turn (ttfbAtRTT): a spell of
// load on the host that runs the VM then falls on every contender alike,
// not on the one measured at that time.
func runTTFB(args []string) error {
	fs := flag.NewFlagSet("ttfb", flag.ExitOnError)
	var p benchjson.TTFBParams
	only := fs.String("contenders", "l7-l7,l4-l4,"+ttfbStandby, "chains to measure, of "+strings.Join(ttfbContenders, ", ")+" ("+ttfbStandby+": l4-l4 whose gateway keeps -standby standby connections)")
	rtts := fs.String("rtts", "1ms,20ms,100ms", "round-trip times between gateway and forwarder (Go durations, comma-separated): netem holds each packet of that path half of one, each way (issue 34 asks for 1 and 20 ms; 100 ms makes the round trips across the path stand out of the CPU time's spread under TCG)")
	fs.IntVar(&p.Conns, "conns", 40, "measured connections per contender and RTT, one after the other, to the chains in turn")
	pause := fs.Duration("pause", 250*time.Millisecond, "quiet after each measured connection, 3 RTT more, so that a gateway's standby refill (a connect and a TLS handshake across the delayed path) is done before the next; the same for every contender")
	settle := fs.Duration("settle", 2*time.Second, "quiet after the uncounted first connection of every chain at each RTT, while the gateways fill their standby connections")
	fs.IntVar(&p.Standby, "standby", 4, "the gateway's standby option in "+ttfbStandby)
	fs.IntVar(&p.Req, "req", 1024, "request bytes of each connection's one call")
	fs.IntVar(&p.Resp, "resp", 4096, "response bytes of each connection's one call (at least 1)")
	fs.IntVar(&p.Probes, "probes", 15, "TCP connects per figure of a path check (the fastest is the figure)")
	fs.Float64Var(&p.ToleranceRel, "tolerance-rel", 0.3, "path check: the share of the RTT asked the RTT the delay added may be off by (plus -tolerance-ms)")
	fs.Float64Var(&p.ToleranceMs, "tolerance-ms", 0.5, "path check: what the RTT the delay added may be off by besides -tolerance-rel, and what the delay may add to a connect to 127.0.0.1 above half the RTT asked")
	fs.StringVar(&p.ForwarderAddr, "forwarder-addr", "127.0.0.2", "the loopback address the forwarder hop listens on: the one address netem delays (not 127.0.0.1, which every other socket uses)")
	fs.StringVar(&p.Device, "dev", "lo", "the device whose egress qdisc delays the path")
	timeout := fs.Duration("call-timeout", 10*time.Second, "deadline of one connection and its call")
	fs.StringVar(&p.PinContender, "pin-contender", "", "CPU list every process of the chains runs on (taskset -c); run this client itself on the others")
	mode := fs.String("mode", "vm", "where this runs, recorded: vm (real time, no icount) or native")
	label := fs.String("label", "", "a label for the report (e.g. smoke)")
	caddyBin := fs.String("caddy", "bin/caddy", "Caddy binary with caddy-l4 and this module")
	out := fs.String("out", "ttfb.json", "JSON output file")
	commit := fs.String("commit", "", "the commit measured (bench.sh passes it)")
	fs.Parse(args)
	rttList, err := parseRTTs(*rtts)
	if err != nil {
		return err
	}
	fwd, err := forwarderAddr(p.ForwarderAddr)
	if err != nil {
		return err
	}
	if p.Conns < 1 || p.Probes < 1 || p.Standby < 1 || p.Req < 0 || p.Resp < 1 || p.Req > maxCallLen || p.Resp > maxCallLen || *pause < 0 || *settle < 0 ||
		p.ToleranceRel < 0 || p.ToleranceRel >= 1 || p.ToleranceMs < 0 {
		return errors.New("-conns, -probes, -standby and -resp must be positive, -req not negative, calls at most 1 MiB, pauses and tolerances not negative, -tolerance-rel below 1")
	}
	names := strings.Split(*only, ",")
	for _, n := range names {
		if !slices.Contains(ttfbContenders, n) {
			return fmt.Errorf("unknown ttfb contender %q (have %s)", n, strings.Join(ttfbContenders, ", "))
		}
	}
	if _, err := exec.LookPath("tc"); err != nil {
		return fmt.Errorf("tc (iproute2) installs the delay: %w", err)
	}
	p.Contenders = names
	for _, r := range rttList {
		p.RTTsMs = append(p.RTTsMs, durMs(r))
	}
	p.PauseMs, p.SettleMs, p.CallTimeoutMs = durMs(*pause), durMs(*settle), timeout.Milliseconds()

	h, err := newHarness(*caddyBin, "ktls-ttfb-")
	if err != nil {
		return err
	}
	defer h.close()
	probes, err := startProbes(fwd)
	if err != nil {
		return err
	}
	defer probes.close()

	rep := &benchjson.TTFBReport{Header: newHeader(benchjson.TTFBKind, benchjson.TTFBSchema, *mode, *label, *commit),
		Params: p, Notes: ttfbNotes(p), OK: true}
	kernelTLS := kerneltest.Available()
	var chains []*ttfbChain
	defer func() {
		for _, c := range chains {
			c.close()
		}
	}()
	for _, name := range names {
		c, _ := findContender(strings.TrimSuffix(name, "-standby"))
		if (c.kernelTX || c.kernelRX) && kernelTLS != nil {
			reason := fmt.Sprintf("this kernel has no kTLS (%v)", kernelTLS)
			log.Printf("REFUSED %s: %s", name, reason)
			rep.Skipped = append(rep.Skipped, benchjson.Skipped{Contender: name, Reason: reason})
			rep.OK = false
			continue
		}
		env := &runEnv{dir: h.dir, caddy: h.caddy, self: h.self, listen: freeAddr(), hopListen: freeAddrOn(fwd), up: h.up, pki: h.pki}
		if name == ttfbStandby {
			env.gatewayStandby = p.Standby
		}
		ch, err := startTTFBChain(name, c, env, p)
		if err != nil {
			log.Printf("FAIL %s: %v", name, err)
			rep.Skipped = append(rep.Skipped, benchjson.Skipped{Contender: name, Reason: "not started: " + err.Error()})
			rep.OK = false
			continue
		}
		chains = append(chains, ch)
		log.Printf("== ttfb %s: gateway %s, forwarder %s", name, env.listen, env.hopListen)
	}
	s := ttfbSetup{p: p, pause: *pause, settle: *settle, timeout: *timeout, probes: probes}
	for _, rtt := range rttList {
		if len(chains) == 0 {
			break
		}
		path, results := ttfbAtRTT(chains, rtt, s)
		rep.Paths = append(rep.Paths, path)
		rep.Results = append(rep.Results, results...)
		if !path.OK || len(path.Errors) > 0 {
			rep.OK = false
		}
		for _, r := range results {
			if len(r.Errors) > 0 {
				rep.OK = false
			}
		}
	}
	return writeReport(*out, rep, rep.OK, "bench ttfb", len(rep.Results), "see the errors in "+*out)
}

// ttfbSetup is what every contender of a ttfb run shares.
type ttfbSetup struct {
	p                      benchjson.TTFBParams
	pause, settle, timeout time.Duration
	probes                 *probes
}

// parseRTTs reads -rtts: positive Go durations, comma-separated, none
// twice, each a whole number of microseconds once halved (netem's delay,
// as tc takes it).
func parseRTTs(s string) ([]time.Duration, error) {
	var out []time.Duration
	for f := range strings.SplitSeq(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		d, err := time.ParseDuration(f)
		switch {
		case err != nil:
			return nil, fmt.Errorf("-rtts %q: %w", s, err)
		case d <= 0:
			return nil, fmt.Errorf("-rtts %q: %s is not a positive duration", s, f)
		case d%(2*time.Microsecond) != 0:
			return nil, fmt.Errorf("-rtts %q: half of %s is not a whole number of microseconds", s, f)
		case slices.Contains(out, d):
			return nil, fmt.Errorf("-rtts %q: %s twice", s, f)
		}
		out = append(out, d)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-rtts %q: no RTT", s)
	}
	return out, nil
}

// forwarderAddr checks -forwarder-addr: an IPv4 loopback address other
// than 127.0.0.1, which the sockets netem must not delay use.
func forwarderAddr(s string) (netip.Addr, error) {
	a, err := netip.ParseAddr(s)
	if err != nil || !a.Is4() || !a.IsLoopback() || a == netip.AddrFrom4([4]byte{127, 0, 0, 1}) {
		return netip.Addr{}, fmt.Errorf("-forwarder-addr %q: want an IPv4 loopback address other than 127.0.0.1", s)
	}
	return a, nil
}

// netemBand is the prio band netem hangs on; netemHandle its handle.
const (
	netemBand   = "1:3"
	netemHandle = "30:"
)

// netemCommands are the tc command lines (without "tc") that delay every
// IPv4 packet to or from addr leaving dev by half of rtt, and no other
// packet: a root prio qdisc whose priomap sends all traffic to its first
// band, two u32 filters that send the packets with addr as destination or
// as source to its third, and netem on that band. A packet from addr to
// addr matches the first filter and is delayed once.
func netemCommands(dev string, addr netip.Addr, rtt time.Duration) [][]string {
	prio := []string{"qdisc", "add", "dev", dev, "root", "handle", "1:", "prio", "bands", "3", "priomap"}
	for range 16 {
		prio = append(prio, "0")
	}
	delay := strconv.FormatInt((rtt/2).Microseconds(), 10) + "us"
	filter := func(pref, dir string) []string {
		return []string{"filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", pref, "u32", "match", "ip", dir, addr.String() + "/32", "flowid", netemBand}
	}
	return [][]string{
		prio,
		{"qdisc", "add", "dev", dev, "parent", netemBand, "handle", netemHandle, "netem", "delay", delay, "limit", "10000"},
		filter("1", "dst"),
		filter("2", "src"),
	}
}

// netemRemove is the tc command line that removes what netemCommands
// installed.
func netemRemove(dev string) []string {
	return []string{"qdisc", "del", "dev", dev, "root"}
}

// runTC runs tc with args; its failure says what the kernel may lack.
func runTC(args []string) error {
	out, err := exec.Command("tc", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("tc %s: %v: %s (a qdisc or filter kind unknown to the kernel: in the VM, are sch_prio, sch_netem and cls_u32 in integration/vm.sh's MODULES?)",
			strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// installNetem runs cmds; on a failure it removes what it installed.
func installNetem(dev string, cmds [][]string) error {
	for _, c := range cmds {
		if err := runTC(c); err != nil {
			runTC(netemRemove(dev))
			return err
		}
	}
	return nil
}

// netemCounters are the packets the netem qdisc on dev sent and dropped,
// from `tc -s -j qdisc show`.
func netemCounters(dev string) (packets, drops int64, err error) {
	out, err := exec.Command("tc", "-s", "-j", "qdisc", "show", "dev", dev).Output()
	if err != nil {
		return 0, 0, fmt.Errorf("tc -s -j qdisc show dev %s: %w", dev, err)
	}
	return parseNetemCounters(out)
}

// parseNetemCounters reads the netem qdisc's counters from the JSON of
// `tc -s -j qdisc show`; there must be exactly one.
func parseNetemCounters(data []byte) (packets, drops int64, err error) {
	var qdiscs []struct {
		Kind    string `json:"kind"`
		Handle  string `json:"handle"`
		Packets int64  `json:"packets"`
		Drops   int64  `json:"drops"`
	}
	if err := json.Unmarshal(data, &qdiscs); err != nil {
		return 0, 0, fmt.Errorf("tc's qdisc JSON: %w", err)
	}
	found := 0
	for _, q := range qdiscs {
		if q.Kind == "netem" {
			found++
			packets, drops = q.Packets, q.Drops
		}
	}
	if found != 1 {
		return 0, 0, fmt.Errorf("tc shows %d netem qdiscs, want 1", found)
	}
	return packets, drops, nil
}

// pathBand is the band a path check's RTT must fall in for rtt asked:
// within rel × rtt + ms of it, not below 0.
func pathBand(rtt time.Duration, rel, ms float64) (low, high float64) {
	asked := durMs(rtt)
	return round(max(0, asked*(1-rel)-ms), 3), round(asked*(1+rel)+ms, 3)
}

// probes are two listeners of this process that TCP connects time: one
// on the forwarder's address (the delayed path), one on 127.0.0.1 (the
// paths that must not be).
type probes struct {
	fwd, local net.Listener
	wg         sync.WaitGroup
}

// fwdAddr is the forwarders' address.
func (p *probes) fwdAddr() netip.Addr {
	return netip.MustParseAddrPort(p.fwd.Addr().String()).Addr()
}

func startProbes(fwd netip.Addr) (*probes, error) {
	p := &probes{}
	var err error
	if p.fwd, err = net.Listen("tcp", netip.AddrPortFrom(fwd, 0).String()); err != nil {
		return nil, err
	}
	if p.local, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		p.fwd.Close()
		return nil, err
	}
	for _, ln := range []net.Listener{p.fwd, p.local} {
		p.wg.Go(func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		})
	}
	return p, nil
}

func (p *probes) close() {
	p.fwd.Close()
	p.local.Close()
	p.wg.Wait()
}

// pathBatches bounds the batches of probes a path check takes with the
// delay in place.
const pathBatches = 3

// connectFastest is the fastest of n TCP connects to ln's address, one
// after the other (ms): a connect returns once the SYN-ACK is back, one
// round trip. Under TCG a connect's own time varies by milliseconds,
// always upward, so the fastest is the figure that shows the path's.
func connectFastest(ln net.Listener, n int) (float64, error) {
	ap := netip.MustParseAddrPort(ln.Addr().String())
	best := time.Duration(math.MaxInt64)
	for range n {
		d, err := connectTime(ap)
		if err != nil {
			return 0, fmt.Errorf("probe connect to %s: %w", ap, err)
		}
		best = min(best, d)
		time.Sleep(2 * time.Millisecond)
	}
	return durMs(best), nil
}

// connectTime times one blocking TCP connect to ap, on a thread of its
// own: Go's netpoller, whose wake-ups under TCG add milliseconds, stays
// out of it. A connect a signal interrupted is retried on a new socket.
func connectTime(ap netip.AddrPort) (time.Duration, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return 0, err
		}
		// A bound on the connect (SO_SNDTIMEO bounds it on Linux).
		tv := unix.Timeval{Sec: 10}
		if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv); err != nil {
			unix.Close(fd)
			return 0, err
		}
		start := time.Now()
		err = unix.Connect(fd, &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()})
		d := time.Since(start)
		unix.Close(fd)
		if err == unix.EINTR {
			continue
		}
		return d, err
	}
}

// nearestRank is the p-th percentile of xs by nearest rank: the smallest
// value with at least p % of the values at or below it (0 for none).
func nearestRank(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// durMs is d in ms, to the µs.
func durMs(d time.Duration) float64 { return round(float64(d)/float64(time.Millisecond), 3) }

// ttfbChain is a running chain and how one connection through it is
// measured.
type ttfbChain struct {
	name  string
	fwd   netip.AddrPort
	procs []*process
	stop  func()
	call  func(context.Context) (time.Duration, error)
	// closeCall releases what call holds.
	closeCall func()
}

// startTTFBChain starts c's processes, pinned to p.PinContender.
func startTTFBChain(name string, c contender, env *runEnv, p benchjson.TTFBParams) (*ttfbChain, error) {
	hops, err := c.hops(env)
	if err != nil {
		return nil, err
	}
	procs, stop, err := startChain(name, hops, env.dir, p.PinContender, "ttfb")
	if err != nil {
		return nil, err
	}
	call, closeCall := ttfbCall(c, c.gateway(env, false), p.Req, p.Resp)
	return &ttfbChain{name: name, fwd: netip.MustParseAddrPort(env.hopListen), procs: procs, stop: stop, call: call, closeCall: closeCall}, nil
}

func (c *ttfbChain) close() {
	c.closeCall()
	c.stop()
}

// exited is the error of a process of the chain that has exited, or nil.
func (c *ttfbChain) exited() error {
	for _, p := range c.procs {
		select {
		case <-p.exited:
			return fmt.Errorf("%s of %s exited; log:\n%s", p.name, c.name, tail(p.log))
		default:
		}
	}
	return nil
}

// startChain starts a chain's hops back to front, each pinned to pin and
// logging to dir/name.hop.run.log, and waits for each to listen; stop
// ends them.
func startChain(name string, hops []hop, dir, pin, run string) ([]*process, func(), error) {
	var procs []*process
	stop := func() {
		for _, p := range procs {
			p.stop()
		}
	}
	for i := len(hops) - 1; i >= 0; i-- {
		hops[i].cmd = pinned(hops[i].cmd, pin)
		p, err := startProcess(hops[i], filepath.Join(dir, name+"."+hops[i].name+"."+run+".log"))
		if err != nil {
			stop()
			return nil, nil, err
		}
		procs = append(procs, p)
		if err := waitListening(hops[i].listen, p.exited); err != nil {
			stop()
			return nil, nil, fmt.Errorf("%s: %w; log:\n%s", hops[i].name, err, tail(p.log))
		}
	}
	return procs, stop, nil
}

// ttfbPause is the quiet after a measured connection at rtt: pause, and
// 3 RTT more, in which a standby refill (a connect and a TLS handshake,
// 2 RTT) is done before the next connection.
func ttfbPause(pause, rtt time.Duration) time.Duration { return pause + 3*rtt }

// ttfbOrder is the order of the chains in round i: each starts a round as
// often as the others, and follows each of the others as often.
func ttfbOrder(i, chains int) []int {
	out := make([]int, chains)
	for j := range out {
		out[j] = (i + j) % chains
	}
	return out
}

// ttfbAtRTT installs the delay for rtt, checks it, and measures the
// chains' connections: one uncounted connection each, the settle time,
// then rounds of one connection per chain, in turn (ttfbOrder).
func ttfbAtRTT(chains []*ttfbChain, rtt time.Duration, s ttfbSetup) (path *benchjson.Path, results []*benchjson.TTFBResult) {
	p := s.p
	path = &benchjson.Path{RTTMs: durMs(rtt)}
	for _, c := range chains {
		results = append(results, &benchjson.TTFBResult{Contender: c.name, RTTMs: durMs(rtt)})
	}
	fail := func(format string, args ...any) (*benchjson.Path, []*benchjson.TTFBResult) {
		path.Errors = append(path.Errors, fmt.Sprintf(format, args...))
		log.Printf("FAIL at %v: %s", rtt, path.Errors[len(path.Errors)-1])
		return path, results
	}
	var err error
	if path.ForwarderBeforeMs, err = connectFastest(s.probes.fwd, p.Probes); err != nil {
		return fail("path check before the delay: %v", err)
	}
	if path.LocalBeforeMs, err = connectFastest(s.probes.local, p.Probes); err != nil {
		return fail("path check of 127.0.0.1 before the delay: %v", err)
	}
	cmds := netemCommands(p.Device, s.probes.fwdAddr(), rtt)
	for _, c := range cmds {
		path.Commands = append(path.Commands, "tc "+strings.Join(c, " "))
	}
	if err := installNetem(p.Device, cmds); err != nil {
		return fail("installing the delay: %v", err)
	}
	defer func() {
		if err := runTC(netemRemove(p.Device)); err != nil {
			path.Errors = append(path.Errors, "removing the delay: "+err.Error())
		}
	}()
	path.LowMs, path.HighMs = pathBand(rtt, p.ToleranceRel, p.ToleranceMs)
	path.LocalHighMs = round(path.RTTMs/2+p.ToleranceMs, 3)
	// With the delay, batches of probes until the check passes: each
	// figure is the fastest connect of every batch so far. Under TCG each
	// delayed packet also waits for its vCPU to wake, so at 1 ms a batch's
	// fastest can exceed the band where the next one's does not.
	for path.Batches = 1; ; path.Batches++ {
		f, err := connectFastest(s.probes.fwd, p.Probes)
		if err != nil {
			return fail("path check: %v", err)
		}
		l, err := connectFastest(s.probes.local, p.Probes)
		if err != nil {
			return fail("path check of 127.0.0.1: %v", err)
		}
		if path.Batches == 1 {
			path.ForwarderMs, path.LocalMs = f, l
		}
		path.ForwarderMs, path.LocalMs = min(path.ForwarderMs, f), min(path.LocalMs, l)
		path.AddedMs = round(path.ForwarderMs-path.ForwarderBeforeMs, 3)
		path.LocalAddedMs = round(path.LocalMs-path.LocalBeforeMs, 3)
		path.OK = path.AddedMs >= path.LowMs && path.AddedMs <= path.HighMs && path.LocalAddedMs < path.LocalHighMs
		if path.OK || path.Batches == pathBatches {
			break
		}
	}
	log.Printf("   at %v: the delay adds %.3f ms to a connect to %s (%.3f before), %.3f to one to 127.0.0.1 (%d batches of probes)", rtt, path.AddedMs, s.probes.fwdAddr(), path.ForwarderBeforeMs, path.LocalAddedMs, path.Batches)
	if !path.OK {
		return fail("path check: the delay adds %.3f ms to a connect to %s (%.3f before, %.3f with it), want %.3f to %.3f for an RTT of %v; %.3f ms to one to 127.0.0.1 (%.3f before, %.3f with it), want below %.3f",
			path.AddedMs, s.probes.fwdAddr(), path.ForwarderBeforeMs, path.ForwarderMs, path.LowMs, path.HighMs, rtt,
			path.LocalAddedMs, path.LocalBeforeMs, path.LocalMs, path.LocalHighMs)
	}

	one := func(c *ttfbChain) (time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
		defer cancel()
		return c.call(ctx)
	}
	var active []int
	for i, c := range chains {
		d, err := one(c)
		if err != nil {
			results[i].Errors = append(results[i].Errors, "the uncounted first connection: "+err.Error())
			continue
		}
		results[i].WarmupMs = durMs(d)
		active = append(active, i)
	}
	time.Sleep(s.settle)
	pk, dr, err := netemCounters(p.Device)
	if err != nil {
		return fail("%v", err)
	}
	pause := ttfbPause(s.pause, rtt)
	for round := range p.Conns {
		for _, k := range ttfbOrder(round, len(active)) {
			i := active[k]
			r := results[i]
			d, err := one(chains[i])
			if err != nil {
				r.Failed++
				if r.FirstError == "" {
					r.FirstError = err.Error()
				}
			} else {
				r.SamplesMs = append(r.SamplesMs, durMs(d))
			}
			// The quiet after a connection is its chain's: a standby
			// refill's packets count to it.
			time.Sleep(pause)
			pk1, dr1, err := netemCounters(p.Device)
			if err != nil {
				return fail("%v", err)
			}
			r.NetemPackets, r.NetemDrops = r.NetemPackets+pk1-pk, r.NetemDrops+dr1-dr
			pk, dr = pk1, dr1
		}
	}
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return fail("%v", err)
	}
	var fwds []netip.AddrPort
	for _, c := range chains {
		fwds = append(fwds, c.fwd)
	}
	conns, err := checkForwarderSockets(data, fwds)
	if err != nil {
		return fail("%v", err)
	}
	for i, c := range chains {
		r := results[i]
		r.ForwarderConns = conns[c.fwd]
		r.N = len(r.SamplesMs)
		r.MinMs, r.P50Ms, r.P90Ms = nearestRank(r.SamplesMs, 0), nearestRank(r.SamplesMs, 50), nearestRank(r.SamplesMs, 90)
		r.P99Ms, r.MaxMs = nearestRank(r.SamplesMs, 99), nearestRank(r.SamplesMs, 100)
		if r.Failed > 0 {
			r.Errors = append(r.Errors, fmt.Sprintf("%d of %d connections failed; the first: %s", r.Failed, p.Conns, r.FirstError))
		}
		if slices.Contains(active, i) && r.NetemPackets == 0 {
			r.Errors = append(r.Errors, "netem delayed no packet in its connections' turns: they did not cross the gateway↔forwarder path")
		}
		if err := c.exited(); err != nil {
			r.Errors = append(r.Errors, err.Error())
		}
		log.Printf("   %s at %v: warm-up %.2f ms, n %d, failed %d, min %.2f p50 %.2f p90 %.2f p99 %.2f max %.2f ms, netem %d packets, %d forwarder connections %v",
			c.name, rtt, r.WarmupMs, r.N, r.Failed, r.MinMs, r.P50Ms, r.P90Ms, r.P99Ms, r.MaxMs, r.NetemPackets, r.ForwarderConns, r.Errors)
	}
	return path, results
}

// tcpSocket is one line of /proc/net/tcp.
type tcpSocket struct {
	local, remote netip.AddrPort
	state         uint8
}

// tcpEstablished is TCP_ESTABLISHED in /proc/net/tcp's st column.
const tcpEstablished = 1

// parseProcNetTCP reads /proc/net/tcp: per socket its local and remote
// address (an IPv4 address as the kernel's 32-bit word in hex, in the
// host's byte order, here little endian; a port in hex) and its state.
func parseProcNetTCP(data []byte) ([]tcpSocket, error) {
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	if len(lines) == 0 || !strings.HasPrefix(strings.TrimSpace(lines[0]), "sl") {
		return nil, errors.New("/proc/net/tcp: no header line")
	}
	addr := func(s string) (netip.AddrPort, error) {
		ip, port, ok := strings.Cut(s, ":")
		b, err := hex.DecodeString(ip)
		if !ok || err != nil || len(b) != 4 {
			return netip.AddrPort{}, fmt.Errorf("/proc/net/tcp: address %q", s)
		}
		n, err := strconv.ParseUint(port, 16, 16)
		if err != nil {
			return netip.AddrPort{}, fmt.Errorf("/proc/net/tcp: port in %q", s)
		}
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte{b[3], b[2], b[1], b[0]}), uint16(n)), nil
	}
	var out []tcpSocket
	for _, line := range lines[1:] {
		f := strings.Fields(line)
		if len(f) < 4 {
			return nil, fmt.Errorf("/proc/net/tcp: line %q", line)
		}
		l, err := addr(f[1])
		if err != nil {
			return nil, err
		}
		r, err := addr(f[2])
		if err != nil {
			return nil, err
		}
		st, err := strconv.ParseUint(f[3], 16, 8)
		if err != nil {
			return nil, fmt.Errorf("/proc/net/tcp: state in %q", line)
		}
		out = append(out, tcpSocket{local: l, remote: r, state: uint8(st)})
	}
	return out, nil
}

// checkForwarderSockets checks, from /proc/net/tcp, that every
// established connection with an end on the forwarders' address has that
// end at a forwarder's listener (one of fwds, which share the address):
// the delay, which matches the address, then holds the gateway↔forwarder
// paths alone. It returns how many connections each listener has.
func checkForwarderSockets(procNetTCP []byte, fwds []netip.AddrPort) (map[netip.AddrPort]int, error) {
	socks, err := parseProcNetTCP(procNetTCP)
	if err != nil {
		return nil, err
	}
	n := map[netip.AddrPort]int{}
	for _, s := range socks {
		if s.state != tcpEstablished {
			continue
		}
		for _, end := range []netip.AddrPort{s.local, s.remote} {
			if slices.ContainsFunc(fwds, func(f netip.AddrPort) bool { return f.Addr() == end.Addr() }) && !slices.Contains(fwds, end) {
				return nil, fmt.Errorf("an established connection %s ↔ %s has an end on the forwarders' address but at no forwarder's listener (%v): netem delays it too", s.local, s.remote, fwds)
			}
		}
		if slices.Contains(fwds, s.local) {
			n[s.local]++
		}
	}
	return n, nil
}

// ttfbCall returns how one connection is measured: a new connection to
// the gateway that makes one call (req bytes up, resp down, every byte
// checked), timed from the start of its TCP connect to the first byte of
// the response. HTTPS (l7 gateways): a request on a connection of its own
// (no keep-alive), to the first byte of the response's head. TLS (l4-l4):
// connect and TLS handshake as bench run's gateway dials, the call's
// header and request in one write, to the first byte back. close releases
// the HTTP transport.
func ttfbCall(c contender, g *gateway, req, resp int) (call func(context.Context) (time.Duration, error), close func()) {
	if c.dialKind == "https" {
		tr := &http.Transport{TLSClientConfig: g.tls, DisableKeepAlives: true, DisableCompression: true}
		return func(ctx context.Context) (time.Duration, error) {
			seed := nextSeed()
			body, want := make([]byte, req), make([]byte, resp)
			callBytes(body, want, seed, 0)
			var mu sync.Mutex
			var start, first time.Time
			trace := &httptrace.ClientTrace{
				ConnectStart: func(string, string) {
					mu.Lock()
					defer mu.Unlock()
					if start.IsZero() {
						start = time.Now()
					}
				},
				GotFirstResponseByte: func() {
					mu.Lock()
					defer mu.Unlock()
					first = time.Now()
				},
			}
			url := fmt.Sprintf("%s/call?seed=%d&i=0&req=%d&resp=%d", g.base, seed, req, resp)
			r, err := g.request(httptrace.WithClientTrace(ctx, trace), http.MethodPost, url, bytes.NewReader(body))
			if err != nil {
				return 0, err
			}
			got, err := g.httpDo(tr, r, resp)
			if err != nil {
				return 0, err
			}
			if !bytes.Equal(got, want) {
				return 0, fmt.Errorf("%d response bytes that differ from the call's %d", len(got), resp)
			}
			mu.Lock()
			defer mu.Unlock()
			if start.IsZero() || first.IsZero() {
				return 0, errors.New("the request made no connection of its own")
			}
			return first.Sub(start), nil
		}, tr.CloseIdleConnections
	}
	dial := g.dial
	return func(ctx context.Context) (time.Duration, error) {
		seed := nextSeed()
		body, want, got := make([]byte, req), make([]byte, resp), make([]byte, resp)
		callBytes(body, want, seed, 0)
		msg := append(header{op: opSmall, req: uint32(req), resp: uint32(resp), seed: seed, n: 1}.marshal(), body...)
		start := time.Now()
		conn, err := dial(ctx)
		if err != nil {
			return 0, err
		}
		defer conn.Close()
		if _, err := conn.Write(msg); err != nil {
			return 0, err
		}
		if _, err := io.ReadFull(conn, got[:1]); err != nil {
			return 0, fmt.Errorf("the response's first byte: %w", err)
		}
		d := time.Since(start)
		if _, err := io.ReadFull(conn, got[1:]); err != nil {
			return 0, fmt.Errorf("the response: %w", err)
		}
		if !bytes.Equal(got, want) {
			return 0, errors.New("response bytes that differ from the payload")
		}
		if err := closeWrite(conn); err != nil {
			return 0, fmt.Errorf("ending the tunnel: %w", err)
		}
		if err := expectEOF(conn); err != nil {
			return 0, fmt.Errorf("after the response: %w", err)
		}
		return d, nil
	}, func() {}
}

// ttfbNotes describe the method, recorded in the JSON and rendered.
func ttfbNotes(p benchjson.TTFBParams) []string {
	return []string{
		fmt.Sprintf("chains: each contender is two Caddy processes, the gateway (on 127.0.0.1, where the client connects) and the forwarder hop behind it (on %s, an address of its own), as bench run starts them (docs/bench/gateway.md): l7-l7 is reverse_proxy to a dataplane reverse_proxy over mutual TLS, its HTTP/1.1 tunnels pooled; l4-l4 is the ktls handler and sandbox_proxy to this project's ktls+sandbox forwarder, a tunnel per user connection; %s is l4-l4 whose sandbox_proxy has standby %d (connections with mutual TLS done, waiting for a tunnel's preamble). Both reach the bench's upstream on 127.0.0.1.", p.ForwarderAddr, ttfbStandby, p.Standby),
		fmt.Sprintf("delay: netem on %s's egress holds every IPv4 packet to or from %s half the RTT (a prio qdisc sends those, by two u32 filters, to the band netem is on, and the rest to one without); on loopback a packet passes that qdisc once, so the gateway↔forwarder round trip is the RTT, and the client↔gateway and forwarder↔upstream paths (127.0.0.1 at both ends) are not delayed. After each RTT's connections every established connection on %s must be one of a forwarder's listener's.", p.Device, p.ForwarderAddr, p.ForwarderAddr),
		fmt.Sprintf("path check: per RTT, the fastest of %d blocking TCP connects (one round trip each) of the client to a listener of its own on %s, before the delay and with it (with it, up to %d batches of %d until the check passes, the fastest of all): their difference is the round trip the delay added, which must be within ±%g %% + %g ms of the RTT asked; the same to a listener on 127.0.0.1 must grow by less than half the RTT + %g ms. The fastest, not the median: under TCG a connect's own time varies by milliseconds, upward, and each delayed packet also waits for its vCPU to wake.", p.Probes, p.ForwarderAddr, pathBatches, p.Probes, p.ToleranceRel*100, p.ToleranceMs, p.ToleranceMs),
		fmt.Sprintf("time to first byte: every chain runs at once (its forwarder on a port of its own). At each RTT, one uncounted connection per chain first (it opens the L7 gateway's pooled tunnel and starts the standby refill), %g ms of quiet, then %d rounds of one new connection per chain, the chains in turn (each starts a round as often as the others), each followed by %g ms + 3 RTT of quiet (a standby refill, a connect and a TLS handshake across the path, is done by then; netem's packets in that quiet count to the chain just measured). Each connection is timed from the start of its TCP connect to the gateway to the first byte of its one call's response (%d B up, %d B down, every byte checked): for l7 gateways an HTTPS request on a connection of its own to the first byte of the response's head; for l4-l4 the TLS 1.3 connection to the gateway, the call's header and request in one write, the first byte back. The client's own TLS handshake with the gateway (a full one) is in every figure. Percentiles by nearest rank.", p.SettleMs, p.Conns, p.PauseMs, p.Req, p.Resp),
		"round trips across the path: the slope of p50 between the lowest and the highest RTT, (p50 at the highest − p50 at the lowest) ÷ (their difference): the gateway↔forwarder round trips a new connection waits for, as far as its CPU time is the same at both RTTs. A tunnel of its own takes 3 (connect, TLS handshake, the preamble and the call), a standby connection or a pooled tunnel 1. l4-l4-standby's CPU time is not the same: the refill its connection starts (a connect, then a TLS handshake with the forwarder) competes with the connection for the chains' one vCPU at a low RTT, and has not reached the forwarder by the first byte at a high one, which lowers its slope.",
		"a failed connection fails the run, as does a path check out of its band, netem delaying no packet in a chain's turns, or a process of a chain exiting.",
	}
}

package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ktlsingress/caddy-ktls/integration/internal/benchjson"
)

// loadGen is the open-loop load generator of one contender and shape: calls
// arrive on a Poisson schedule whatever the contender does, each on a slot
// (reuse: an idle tunnel of a fixed set; per-call: room for one more
// connection), and an arrival that finds no slot is counted as
// generator-saturated instead of waiting, so the generator's goroutines stay
// bounded by its slots at any load. A call's latency runs from its
// scheduled arrival, not from when it started: time spent behind a late
// generator or a slow contender counts (no coordinated omission).
type loadGen struct {
	// reuse: calls go over long-lived tunnels (or HTTP connections), one
	// call at a time each; otherwise every call opens its own connection.
	reuse bool
	// dials: for the raw contenders, one dialer per target (a tunnel
	// to target i uses dials[i%len(dials)]); nil for HTTP.
	dials []func(context.Context) (net.Conn, error)
	// base and tr: the HTTP contender's origin and its client transport.
	base string
	tr   *http.Transport
	// serverName is the HTTP requests' Host.
	serverName string
	req, resp  int
	timeout    time.Duration
	idle       chan *loadTunnel // reuse, raw: the tunnels not in a call
	slots      chan struct{}    // per-call and HTTP: free room for a call
	nextTarget atomic.Uint64
	tunnels    []*loadTunnel
	// hops: the contender's processes, whose CPU, memory and counters a
	// step reports (none: not recorded).
	hops []loadHop
	// classify names a failed call's class and cause (classify, or
	// classifyChain for a chain).
	classify func(error) (class, cause string)
	// handshakes and resumed count the HTTP contender's new connections'
	// TLS handshakes and those that resumed a session.
	handshakes, resumed atomic.Int64
	// established counts the tunnels and connections whose first call
	// completed: each of them the contender has surely taken on (a
	// kernel-TLS contender installed its keys).
	established    atomic.Int64
	openedOnDemand atomic.Int64
}

// loadTunnel is one long-lived tunnel of the reuse shape: its stream seed
// and the index of its next call; conn is nil until it is (re)opened.
type loadTunnel struct {
	dial func(context.Context) (net.Conn, error)
	conn net.Conn
	seed uint32
	next uint64
	// established is the generator's count of tunnels with a completed
	// first call.
	established    *atomic.Int64
	req, want, got []byte
}

// newLoadGen makes a generator with slots tunnels (reuse) or concurrent
// connections (per-call); raw contenders give dials, the HTTP one base and
// tr.
func newLoadGen(reuse bool, slots int, dials []func(context.Context) (net.Conn, error), base string, tr *http.Transport, serverName string, req, resp int, timeout time.Duration) *loadGen {
	g := &loadGen{reuse: reuse, dials: dials, base: base, tr: tr, serverName: serverName, req: req, resp: resp, timeout: timeout, classify: classify}
	if reuse && dials != nil {
		g.idle = make(chan *loadTunnel, slots)
		for i := range slots {
			t := &loadTunnel{dial: dials[i%len(dials)], established: &g.established, req: make([]byte, req), want: make([]byte, resp), got: make([]byte, resp)}
			g.tunnels = append(g.tunnels, t)
			g.idle <- t
		}
	} else {
		g.slots = make(chan struct{}, slots)
		for range slots {
			g.slots <- struct{}{}
		}
	}
	return g
}

// open opens every tunnel of the reuse shape (parallel at a time) and
// makes one uncounted call on each, so that measured calls find them
// established; on HTTP, as many concurrent calls as slots, which leaves
// the transport that many idle connections. Per-call: one call, which
// fills the gateway's session cache, so that every measured handshake can
// resume.
func (g *loadGen) open(ctx context.Context, parallel int) error {
	n := len(g.tunnels)
	if g.idle == nil {
		n = cap(g.slots)
		if !g.reuse {
			n = 1
		}
	}
	sem := make(chan struct{}, parallel)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			cctx, cancel := context.WithTimeout(ctx, 4*g.timeout)
			defer cancel()
			switch {
			case g.idle != nil:
				errs[i] = g.tunnels[i].call(cctx)
			case g.dials != nil:
				errs[i] = g.perCall(cctx)
			default:
				errs[i] = g.httpCall(cctx)
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// close ends every tunnel: each half-closes and must see the upstream's
// end, with no byte before it.
func (g *loadGen) close() error {
	var errs []error
	for _, t := range g.tunnels {
		if t.conn == nil {
			continue
		}
		t.conn.SetDeadline(time.Now().Add(g.timeout))
		if err := closeWrite(t.conn); err != nil {
			errs = append(errs, err)
		} else if err := expectEOF(t.conn); err != nil {
			errs = append(errs, err)
		}
		t.conn.Close()
		t.conn = nil
	}
	if g.tr != nil {
		g.tr.CloseIdleConnections()
	}
	return errors.Join(errs...)
}

// call makes the tunnel's next call, opening the tunnel first if it is
// closed (the call's latency then includes that). A failed tunnel is closed
// and reopened by its next call.
func (t *loadTunnel) call(ctx context.Context) (err error) {
	phase := phaseCall
	defer func() {
		if err != nil {
			err = &callError{phase: phase, err: err}
			if t.conn != nil {
				abandon(t.conn)
				t.conn = nil
			}
		}
	}()
	if t.conn == nil {
		phase = phaseConnect
		c, err := t.dial(ctx)
		if err != nil {
			return err
		}
		t.conn, t.seed, t.next = c, nextSeed(), 0
		phase = phasePreamble
		if _, err := c.Write(header{op: opLoad, req: uint32(len(t.req)), resp: uint32(len(t.want)), seed: t.seed}.marshal()); err != nil {
			return err
		}
		phase = phaseFirstRead
	}
	d, _ := ctx.Deadline()
	t.conn.SetDeadline(d)
	callBytes(t.req, t.want, t.seed, t.next)
	if _, err := t.conn.Write(t.req); err != nil {
		return err
	}
	if _, err := io.ReadFull(t.conn, t.got); err != nil {
		return err
	}
	if !bytes.Equal(t.got, t.want) {
		return errWrongBytes
	}
	if t.next == 0 {
		t.established.Add(1)
	}
	t.next++
	return nil
}

// perCall makes one call on a connection of its own (the gateway's session
// cache resumes its TLS session) and ends it cleanly.
func (g *loadGen) perCall(ctx context.Context) (err error) {
	phase := phaseConnect
	defer func() {
		if err != nil {
			err = &callError{phase: phase, err: err}
		}
	}()
	dial := g.dials[g.nextTarget.Add(1)%uint64(len(g.dials))]
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			abandon(c)
		} else {
			c.Close()
		}
	}()
	d, _ := ctx.Deadline()
	c.SetDeadline(d)
	seed := nextSeed()
	req, want, got := make([]byte, g.req), make([]byte, g.resp), make([]byte, g.resp)
	callBytes(req, want, seed, 0)
	phase = phasePreamble
	if _, err := c.Write(append(header{op: opSmall, req: uint32(g.req), resp: uint32(g.resp), seed: seed, n: 1}.marshal(), req...)); err != nil {
		return err
	}
	phase = phaseFirstRead
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if !bytes.Equal(got, want) {
		return errWrongBytes
	}
	g.established.Add(1)
	phase = phaseClose
	if err := closeWrite(c); err != nil {
		return err
	}
	return expectEOF(c)
}

// abandon closes the connection of a call that failed: the socket under its
// TLS session, without close_notify, as a gateway that gives up on a call
// goes away. crypto/tls seals a record, spending its sequence number, before
// it writes it, and its Close sends close_notify even after a Write that
// failed: after a Write that met its deadline before a byte left, that
// close_notify would go out under a sequence number the contender never
// received, a record no receiver can authenticate (a kTLS contender's
// kernel fails it with EBADMSG and counts it in TlsDecryptError: ktls
// TestKernelGoClientCloseAfterFailedWrite), which the run would report as
// the contender's error.
func abandon(c net.Conn) error {
	if tc, ok := c.(interface{ NetConn() net.Conn }); ok {
		return tc.NetConn().Close()
	}
	return c.Close()
}

// httpCall makes one call through the HTTP contender (on a pooled
// connection, or a new one per call, as the transport says).
func (g *loadGen) httpCall(ctx context.Context) (err error) {
	phase := phaseCall
	defer func() {
		if err != nil {
			err = &callError{phase: phase, err: err}
		}
	}()
	seed := nextSeed()
	body, want := make([]byte, g.req), make([]byte, g.resp)
	callBytes(body, want, seed, 0)
	url := fmt.Sprintf("%s/call?seed=%d&i=0&req=%d&resp=%d", g.base, seed, g.req, g.resp)
	trace := &httptrace.ClientTrace{TLSHandshakeDone: func(cs tls.ConnectionState, err error) {
		if err == nil {
			g.handshakes.Add(1)
			if cs.DidResume {
				g.resumed.Add(1)
			}
		}
	}}
	r, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	r.Host = g.serverName
	res, err := g.tr.RoundTrip(r)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		io.Copy(io.Discard, io.LimitReader(res.Body, 4096))
		return httpStatusError{res.StatusCode}
	}
	got, err := io.ReadAll(io.LimitReader(res.Body, int64(g.resp)+1))
	if err != nil {
		return err
	}
	if !bytes.Equal(got, want) {
		return errWrongBytes
	}
	return nil
}

// step offers calls at rate for dur on the schedule of seed, waits for the
// calls in flight to end (each bounded by the generator's timeout), and
// returns the step's figures.
func (g *loadGen) step(ctx context.Context, rate float64, dur time.Duration, seed uint64) benchjson.Step {
	sched := poissonSchedule(rate, dur, seed)
	s := benchjson.Step{Rate: rate, Seconds: dur.Seconds(), Offered: len(sched), Errors: map[string]int{}, Causes: map[string]int{}}
	var (
		mu       sync.Mutex
		lat, lag histogram
		wg       sync.WaitGroup
		inWindow int
	)
	counters0 := scrapeHops(g.hops)
	cpu0 := selfCPU()
	cont0, contErr := sampleHops(g.hops)
	start := time.Now()
	end := start.Add(dur)
	for _, at := range sched {
		due := start.Add(at)
		waitUntil(ctx, due)
		lag.record(time.Since(due))
		var t *loadTunnel
		if g.idle != nil {
			select {
			case t = <-g.idle:
			default:
				s.Saturated++
				continue
			}
		} else {
			select {
			case <-g.slots:
			default:
				s.Saturated++
				continue
			}
		}
		wg.Go(func() {
			cctx, cancel := context.WithDeadline(ctx, due.Add(g.timeout))
			var err error
			switch {
			case t != nil:
				err = t.call(cctx)
				g.idle <- t
			case g.dials != nil:
				err = g.perCall(cctx)
			default:
				err = g.httpCall(cctx)
			}
			done := time.Now()
			cancel()
			if t == nil {
				g.slots <- struct{}{}
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				class, cause := g.classify(err)
				s.Errors[class]++
				s.Causes[class+": "+cause]++
				if s.FirstError == "" {
					s.FirstError = err.Error()
				}
				return
			}
			s.Completed++
			if !done.After(end) {
				inWindow++
			}
			lat.record(done.Sub(due))
		})
	}
	wg.Wait()
	wall := time.Since(start).Seconds()
	s.GenCPU = round((selfCPU()-cpu0).Seconds()/wall, 2)
	var cpus []float64
	if cont1, err := sampleHops(g.hops); len(g.hops) > 0 && contErr == nil && err == nil {
		cpus = hopCPUs(cont0, cont1, wall)
	}
	hopStep(&s, g.hops, cpus, counters0, scrapeHops(g.hops))
	s.Goodput = round(float64(inWindow)/dur.Seconds(), 1)
	us := func(d time.Duration) float64 { return round(float64(d)/1e3, 1) }
	s.P50us, s.P99us, s.P999us, s.MaxUs = us(lat.percentile(50)), us(lat.percentile(99)), us(lat.percentile(99.9)), us(lat.max)
	s.LagP99us, s.LagMaxus = us(lag.percentile(99)), us(lag.max)
	if len(s.Errors) == 0 {
		s.Errors, s.Causes = nil, nil
	}
	return s
}

// procMemory is pid's resident set (VmRSS, bytes) and its open file
// descriptors; 0 for what /proc does not say.
func procMemory(pid int) (rss int64, fds int) {
	if status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		for line := range strings.SplitSeq(string(status), "\n") {
			if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				var kb int64
				fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), &kb)
				rss = kb << 10
			}
		}
	}
	if ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid)); err == nil {
		fds = len(ents)
	}
	return rss, fds
}

// timerSlack is how late a Go timer may fire on Linux, whose poller
// sleeps in whole milliseconds.
const timerSlack = 2 * time.Millisecond

// waitUntil returns at t (or when ctx ends): it sleeps to within
// timerSlack of t, then yields until t, so an arrival starts within
// microseconds of its schedule, not a poller tick late.
func waitUntil(ctx context.Context, t time.Time) {
	if d := time.Until(t) - timerSlack; d > 0 {
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return
		}
	}
	for time.Now().Before(t) && ctx.Err() == nil {
		runtime.Gosched()
	}
}

// settle waits until the contender is idle (settleHops), up to limit. A
// step that overloaded it can leave work behind (connections its clients
// abandoned, still queued), which would otherwise burden the next step.
// It returns how long it waited.
func (g *loadGen) settle(ctx context.Context, limit time.Duration) time.Duration {
	return settleHops(ctx, g.hops, limit)
}

// settleHops waits, up to limit, until hops are idle: their CPU (every
// process's together) below idleCores over a half-second window and, for a
// chain, none of their counters moved in it. A chain's gateway counts a
// tunnel when its first byte passes, which can be long after its
// handshakes (a tunnel whose user gave up waits out the forwarder's
// queue): a shape's tallies (key installs per tunnel) start once none is
// left in flight. It returns how long it waited.
func settleHops(ctx context.Context, hops []loadHop, limit time.Duration) time.Duration {
	const window, idleCores = 500 * time.Millisecond, 0.05
	start := time.Now()
	for time.Since(start) < limit && ctx.Err() == nil {
		c0 := scrapeHops(hops) // outside the CPU window: a scrape costs the hop CPU
		a, err := sampleHops(hops)
		if err != nil || len(a) == 0 {
			break
		}
		time.Sleep(window)
		b, err := sampleHops(hops)
		if err != nil {
			break
		}
		var cores float64
		for _, c := range hopCPUs(a, b, window.Seconds()) {
			cores += c
		}
		if cores < idleCores && countersEqual(c0, scrapeHops(hops)) {
			break
		}
	}
	return time.Since(start)
}

// countersEqual reports whether two scrapes of the same hops read the same
// series with the same values.
func countersEqual(a, b []map[string]float64) bool {
	return slices.EqualFunc(a, b, func(x, y map[string]float64) bool { return maps.Equal(x, y) })
}

// selfCPU is this process's user+system CPU time so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// loadTargets are n sandbox targets on port: with n = 1 the loopback
// address alone; otherwise 127.1.x.y, a population of addresses that all
// reach one upstream listening on the wildcard address.
func loadTargets(n int, port uint16) []netip.AddrPort {
	if n <= 1 {
		return []netip.AddrPort{netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), port)}
	}
	out := make([]netip.AddrPort, n)
	for i := range n {
		out[i] = netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 1, byte(i / 254), byte(i%254 + 1)}), port)
	}
	return out
}

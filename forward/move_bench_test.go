package forward

import (
	"context"
	"flag"
	"io"
	"os"
	"runtime"
	"runtime/metrics"
	"runtime/pprof"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/cputest"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

var (
	moveTunnels = flag.Int("move-tunnels", 1000, "BenchmarkMoveIdleTunnels: the idle tunnels moved in each iteration")
	moveWindow  = flag.Int("move-window", 0, "the handoff sessions' window (handoff.Config.Window; 0: its default)")
	moveCollect = flag.Bool("move-collect", false, "let the Go collector run during the move (the sandbox_handoff app holds it off: handoff.HoldCollection)")
	moveProfile = flag.String("move-cpuprofile", "", "write a CPU profile of the move alone, not the tunnels' setup (the last iteration's), to this file")
)

// BenchmarkMoveIdleTunnels moves -move-tunnels idle tunnels as an upgrade
// does: each relay pauses, its gateway connection and its target's travel
// with its state through a handoff session (a SEQPACKET socket,
// SCM_RIGHTS), and a second Forwarder adopts them and resumes the relay.
// The gateway connections are plain TCP, so that it runs on a host without
// kTLS; BenchmarkKernelMoveIdleTunnels moves kernel TLS ones. Reported: the
// time per tunnel moved (ns/tunnel), the whole set's (ms/move), the CPU
// both forwarders used per tunnel while it ran, the report stream's
// handoff and the session's setup included (cpu-ns/tunnel: one process
// here, two in an upgrade), and how long the relays stood still
// (pause-p50-µs, pause-p99-µs, pause-max-µs; MoveResult.Pauses), what
// both allocated per tunnel, how much the process's memory grew per
// tunnel (the new relays' stacks included) and how many collections ran
// in the move (alloc-B/tunnel, grown-B/tunnel, gc/move).
// Each tunnel holds four descriptors in this process (both ends of both
// connections): the benchmark fails at once when the limit is below that
// and a margin. -move-window sets the session's window (Config.Window).
// The collector is held off during the move, as the sandbox_handoff app
// holds it (handoff.HoldCollection), unless -move-collect.
func BenchmarkMoveIdleTunnels(b *testing.B) {
	benchmarkMoveIdle(b, openTCPIdle)
}

// BenchmarkKernelMoveIdleTunnels is BenchmarkMoveIdleTunnels with kernel
// TLS gateway connections (mutual TLS, a signed preamble, both directions
// offloaded): what ktls.Handoff reads of the kernel's session and
// ktls.Adopt checks add to a move. The gateways' ends run userspace TLS in
// this process, so the kernel's counters count the forwarder's sessions
// alone: each is installed once each way, at its handshake, and never at
// its adoption, and the kernel authenticates every record.
func BenchmarkKernelMoveIdleTunnels(b *testing.B) {
	if err := kerneltest.Available(); err != nil {
		b.Skipf("SKIP: %v", err)
	}
	benchmarkMoveIdle(b, openKTLSIdle)
}

func benchmarkMoveIdle(b *testing.B, open func(b *testing.B, n int) *idleTunnels) {
	n := *moveTunnels
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		b.Fatal(err)
	}
	// Four per tunnel, and the duplicates of the tunnels in flight.
	if need := 4*n + 1000; lim.Cur < uint64(need) {
		b.Fatalf("-move-tunnels %d needs some %d descriptors; this process may open %d (ulimit -n)", n, need, lim.Cur)
	}
	var total, cpu time.Duration
	var pauses []time.Duration
	var allocated, collections uint64
	var grown int64
	for range b.N {
		b.StopTimer()
		took, used, mem, res := moveIdle(b, open(b, n))
		b.StartTimer()
		total += took
		cpu += used
		allocated += mem.allocated
		grown += mem.grown
		collections += mem.collections
		pauses = append(pauses, res...)
	}
	b.StopTimer()
	slices.Sort(pauses)
	q := func(p float64) float64 { return float64(pauses[int(p*float64(len(pauses)-1))].Microseconds()) }
	b.ReportMetric(float64(total.Nanoseconds())/float64(b.N*n), "ns/tunnel")
	b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "ms/move")
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N*n), "cpu-ns/tunnel")
	b.ReportMetric(float64(allocated)/float64(b.N*n), "alloc-B/tunnel")
	b.ReportMetric(float64(grown)/float64(b.N*n), "grown-B/tunnel")
	b.ReportMetric(float64(collections)/float64(b.N), "gc/move")
	b.ReportMetric(q(0.5), "pause-p50-µs")
	b.ReportMetric(q(0.99), "pause-p99-µs")
	b.ReportMetric(q(1), "pause-max-µs")
	b.ReportMetric(0, "ns/op")
}

// idleTunnels are tunnels in one forwarder, each idle once the gateway
// read its upstream's byte, and a second forwarder to move them to.
type idleTunnels struct {
	clients []interface {
		io.Reader
		CloseWrite() error
		Close() error
	}
	old, nuReg *Registry
	nu         *Forwarder
	// end runs once every tunnel has ended: it ends the upstream and the
	// old forwarder's serving and checks what they saw.
	end func()
}

// openTCPIdle opens n idle tunnels over plain TCP.
func openTCPIdle(b *testing.B, n int) *idleTunnels {
	old := newFixture(b, func(c *Config) { c.HandOffConn, c.AdoptConn = tcpHandOff, tcpAdopt })
	up := forwardtest.NewPacedUpstream(b, 1, time.Hour) // a byte, then quiet until the client's end
	nu, nuReg := newProcess(b, old.gw)
	set := &idleTunnels{old: old.reg, nu: nu, nuReg: nuReg, end: up.Close}
	for range n {
		c := old.dial(b)
		if _, err := c.Write(old.gw.Frame(b, "sbx-idle", up.Addr())); err != nil {
			b.Fatal(err)
		}
		set.clients = append(set.clients, c)
	}
	return set
}

// openKTLSIdle opens n idle tunnels over kernel TLS, each through a
// gateway's mutual-TLS handshake and signed preamble.
func openKTLSIdle(b *testing.B, n int) *idleTunnels {
	var oldEnds atomic.Int64
	fx := newKTLSMoveFixture(b, ktls.Options{RequireOffload: true}, 0, func(res Result, err error) {
		if err != nil || !res.Moved {
			b.Errorf("old Serve of tunnel %d: moved %v, %v; want it moved", res.Tunnel.ID, res.Moved, err)
		}
		oldEnds.Add(1)
	})
	dialer, err := gateway.New(gateway.Config{TLS: fx.gatewayTLS, Signer: fx.signer, KTLS: ktls.Options{Disable: true}, DialTimeout: time.Minute})
	if err != nil {
		b.Fatal(err)
	}
	up := forwardtest.NewPacedUpstream(b, 1, time.Hour)
	stat0, err := kerneltest.ReadStat()
	if err != nil {
		b.Fatal(err)
	}
	set := &idleTunnels{old: fx.oldReg, nu: fx.nu, nuReg: fx.nuReg}
	for range n {
		c, err := dialer.Dial(context.Background(), gateway.Route{Forwarder: fx.ln.Addr().String(), Sandbox: "sbx-idle", Target: up.Addr()})
		if err != nil {
			b.Fatal(err)
		}
		set.clients = append(set.clients, c)
	}
	set.end = func() {
		up.Close()
		dialer.Close()
		fx.close()
		kerneltest.InstalledOnce(b, stat0, int64(n))
		if got := oldEnds.Load(); got != int64(n) {
			b.Errorf("%d of the old forwarder's Serves returned, want %d", got, n)
		}
	}
	return set
}

// moveIdle moves set's tunnels, once each has read its upstream's byte (so
// its relay has run and is idle), to the second forwarder and returns how
// long MoveTunnels took, the CPU the process used meanwhile, what it
// allocated and collected meanwhile, and each tunnel's pause. It fails b
// unless every tunnel moved and then ended in order through its adopted
// relay, and ends them all before it returns.
func moveIdle(b *testing.B, set *idleTunnels) (took, cpu time.Duration, mem moveMemory, pauses []time.Duration) {
	for _, c := range set.clients {
		if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
			b.Fatal(err)
		}
	}
	n := len(set.clients)
	results := make(chan Result, n)
	var runs sync.WaitGroup
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	alloc0, gc0, total0 := ms.TotalAlloc, ms.NumGC, processMemory()
	cpu0 := cputest.Used(b)
	release := func() {}
	if !*moveCollect {
		release = handoff.HoldCollection(handoff.CollectionHeadroom)
	}
	stopProfile := startMoveProfile(b)
	res, took := upgrade(b, set.old, set.nu, set.nuReg, results, &runs)
	stopProfile()
	release()
	cpu = cputest.Used(b) - cpu0
	runtime.ReadMemStats(&ms)
	mem = moveMemory{allocated: ms.TotalAlloc - alloc0, grown: processMemory() - total0, collections: uint64(ms.NumGC - gc0)}
	if res.Moved != n || len(res.Stayed) != 0 {
		b.Fatalf("moved %d, stayed %v (%v); want all %d moved", res.Moved, res.Stayed, res.Stays, n)
	}
	for _, c := range set.clients { // an orderly end through the adopted relays
		c.CloseWrite()
		if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
			b.Errorf("a moved tunnel's end read %d bytes (%v), want its end alone", n, err)
		}
		c.Close()
	}
	runs.Wait()
	close(results)
	ended := 0
	for r := range results {
		// The counters go on from the old relay's: the upstream's byte.
		if a, z := r.Relay.AToB, r.Relay.BToA; r.Moved || a.Bytes != 0 || z.Bytes != 1 || !a.Spliced || !z.Spliced {
			b.Errorf("adopted tunnel %d: moved %v, relayed %d up and %d down, spliced %v and %v; want it ended here, 0 and 1 bytes, splicing both ways", r.Tunnel.ID, r.Moved, a.Bytes, z.Bytes, a.Spliced, z.Spliced)
		}
		ended++
	}
	if ended != n {
		b.Errorf("%d adopted tunnels ended, want %d", ended, n)
	}
	set.end()
	return took, cpu, mem, res.Pauses
}

// moveMemory is what a move allocated, how much the process's memory grew
// meanwhile (allocations and new goroutines' stacks: what counts against
// HoldCollection's headroom; both sides here), and how many collections
// ran.
type moveMemory struct {
	allocated, collections uint64
	grown                  int64
}

// processMemory is the Go runtime's whole memory (what a memory limit
// counts).
func processMemory() int64 {
	s := []metrics.Sample{{Name: "/memory/classes/total:bytes"}}
	metrics.Read(s)
	return int64(s[0].Value.Uint64())
}

// startMoveProfile starts the CPU profile -move-cpuprofile asks for and
// returns what stops it.
func startMoveProfile(b *testing.B) (stop func()) {
	if *moveProfile == "" {
		return func() {}
	}
	f, err := os.Create(*moveProfile)
	if err != nil {
		b.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		b.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		if err := f.Close(); err != nil {
			b.Error(err)
		}
	}
}

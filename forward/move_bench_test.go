package forward

import (
	"flag"
	"io"
	"net"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/cputest"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
)

var (
	moveTunnels = flag.Int("move-tunnels", 1000, "BenchmarkMoveIdleTunnels: the idle tunnels moved in each iteration")
	moveWindow  = flag.Int("move-window", 0, "the handoff sessions' window (handoff.Config.Window; 0: its default)")
	moveCollect = flag.Bool("move-collect", false, "let the Go collector run during the move (the sandbox_handoff app holds it off: handoff.HoldCollection)")
)

// BenchmarkMoveIdleTunnels moves -move-tunnels idle tunnels as an upgrade
// does: each relay pauses, its gateway connection and its target's travel
// with its state through a handoff session (a SEQPACKET socket,
// SCM_RIGHTS), and a second Forwarder adopts them and resumes the relay.
// The connections are plain TCP, since this host has no kTLS: a kTLS
// tunnel adds what ktls.Handoff reads of the kernel's state and what
// ktls.Adopt checks (a few getsockopt calls). Reported: the time per tunnel
// moved (ns/tunnel), the whole set's (ms/move), the CPU both forwarders
// used per tunnel while it ran, the report stream's handoff and the
// session's setup included (cpu-ns/tunnel: one process here, two in an
// upgrade), and how long the relays stood still (pause-p50-µs,
// pause-p99-µs, pause-max-µs; MoveResult.Pauses).
// Each tunnel holds four descriptors in this process (both ends of both
// connections): the benchmark fails at once when the limit is below that
// and a margin. -move-window sets the session's window (Config.Window).
// The collector is held off during the move, as the sandbox_handoff app
// holds it (handoff.HoldCollection), unless -move-collect.
func BenchmarkMoveIdleTunnels(b *testing.B) {
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
	for range b.N {
		b.StopTimer()
		took, used, res := moveIdle(b, n)
		b.StartTimer()
		total += took
		cpu += used
		pauses = append(pauses, res...)
	}
	b.StopTimer()
	slices.Sort(pauses)
	q := func(p float64) float64 { return float64(pauses[int(p*float64(len(pauses)-1))].Microseconds()) }
	b.ReportMetric(float64(total.Nanoseconds())/float64(b.N*n), "ns/tunnel")
	b.ReportMetric(float64(total.Milliseconds())/float64(b.N), "ms/move")
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N*n), "cpu-ns/tunnel")
	b.ReportMetric(q(0.5), "pause-p50-µs")
	b.ReportMetric(q(0.99), "pause-p99-µs")
	b.ReportMetric(q(1), "pause-max-µs")
	b.ReportMetric(0, "ns/op")
}

// moveIdle opens n idle tunnels in a forwarder, moves them all to a second
// one and returns how long MoveTunnels took, the CPU the process used
// meanwhile and each tunnel's pause. It
// fails b unless every tunnel moved, and ends them all before it returns.
func moveIdle(b *testing.B, n int) (took, cpu time.Duration, pauses []time.Duration) {
	old := newFixture(b, func(c *Config) { c.HandOffConn, c.AdoptConn = tcpHandOff, tcpAdopt })
	up := forwardtest.NewPacedUpstream(b, 1, time.Hour) // a byte, then quiet until the client's end
	nu, nuReg := newProcess(b, old.gw)
	clients := make([]*net.TCPConn, 0, n)
	for range n {
		c := old.dial(b)
		if _, err := c.Write(old.gw.Frame(b, "sbx-idle", up.Addr())); err != nil {
			b.Fatal(err)
		}
		clients = append(clients, c)
	}
	for _, c := range clients { // the upstream's byte: the relay has run and is idle
		if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
			b.Fatal(err)
		}
	}

	results := make(chan Result, n)
	var runs sync.WaitGroup
	cpu0 := cputest.Used(b)
	release := func() {}
	if !*moveCollect {
		release = handoff.HoldCollection(handoff.CollectionHeadroom)
	}
	res, took := upgrade(b, old.reg, nu, nuReg, results, &runs)
	release()
	cpu = cputest.Used(b) - cpu0
	if res.Moved != n || len(res.Stayed) != 0 {
		b.Fatalf("moved %d, stayed %v (%v); want all %d moved", res.Moved, res.Stayed, res.Stays, n)
	}
	for _, c := range clients { // an orderly end through the adopted relays
		c.CloseWrite()
		if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
			b.Errorf("a moved tunnel's end read %d bytes (%v), want its end alone", n, err)
		}
		c.Close()
	}
	runs.Wait()
	up.Close()
	return took, cpu, res.Pauses
}

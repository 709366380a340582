package gateway

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// keyUpdates counts the peer KeyUpdates that sessions applied
// (ktls.EventKeyUpdate), by the session's remote address.
type keyUpdates struct {
	mu      sync.Mutex
	byPeer  map[string]int
	applied int
}

func (k *keyUpdates) observe(ev ktls.Event) {
	if ev.Kind != ktls.EventKeyUpdate {
		return
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.byPeer == nil {
		k.byPeer = map[string]int{}
	}
	k.byPeer[ev.Remote.String()]++
	k.applied++
}

// counts returns how many peers' KeyUpdates were applied, and how many
// KeyUpdates.
func (k *keyUpdates) counts() (peers, applied int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.byPeer), k.applied
}

// Kernel TLS tunnels at the gateway (a user's session spliced to the
// gateway's session with a forwarder, both in kernel TLS) move
// mid-stream to another Dialer, on the sockets, sessions and record
// sequences the kernel holds. Of every three offers, the other process
// takes one, refuses one, and adopts one and then keeps it where it was
// (as when it cannot confirm the adoption): the last two resume here on
// their sessions adopted back. Every byte arrives exact both ways; the
// moved tunnels' Carry end EndMoved and their adopted Run end in order,
// splicing both ways and counting on from the move; no record fails to
// authenticate; each session's keys are installed once (an adoption
// installs none); and where the kernel rekeys (TLS 1.3, Linux >= 6.14)
// the moved sessions renew their keys after the move, both the user's and
// the forwarder's.
func TestKernelGatewayMoveTunnels(t *testing.T) {
	kerneltest.Require(t)
	const n = 4
	forwardtest.CheckLeaks(t)
	rekey := ktls.Probe().Rekey // cached for the process: its throwaway sessions stay out of the counters
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	up := forwardtest.NewPacedUpstream(t, 16<<10, 2*time.Millisecond)
	f := startForwarder(t, p, gw, "127.0.0.0/8")
	userOpts, tunnelOpts := ktls.Options{RequireOffload: true}, ktls.Options{RequireOffload: true}
	if rekey {
		// Keys renewed every 1024 records (16 MiB) on both hops. A
		// session asks its peer to update when the peer's key reaches the
		// limit, and fails when the peer has not by as many records again:
		// the answer comes behind what the sockets' buffers hold (up to
		// some 10 MiB on loopback), so a smaller limit fails tunnels that
		// stream both ways whether they move or not. The count goes on
		// across the move, so the first renewal in the new process comes
		// within 1024 records.
		userOpts.RecordLimit, userOpts.KeyUpdateLimit = 1024, ktls.Rate{PerSecond: 1e6, Burst: 1e6}
		tunnelOpts.RecordLimit = 1024
	}
	old := newKTLSDialer(t, p, gw, tunnelOpts, userOpts)
	defer old.Close()
	var userUpdates, tunnelUpdates keyUpdates
	nuUser, nuTunnel := userOpts, tunnelOpts
	nuUser.Observer, nuTunnel.Observer = userUpdates.observe, tunnelUpdates.observe
	nu := newKTLSDialer(t, p, gw, nuTunnel, nuUser)
	defer nu.Close()
	fr := startFrontWith(t, p, old, Route{Forwarder: f.addr(), Sandbox: "sbx-move", Target: up.Addr()}, userOpts)
	stat0, err := kerneltest.ReadStat()
	if err != nil {
		t.Fatal(err)
	}
	ks0 := ktls.Stats()

	s := startStreams(t, fr, p.client, old, up, n)
	m := &adoptingMover{t: t, to: nu, refuse: func(offer int) bool { return offer%3 == 1 }, keep: func(offer int) bool { return offer%3 == 2 }}
	res := old.MoveTunnels(context.Background(), m)
	moved, kept := 0, 0
	for offer := range n {
		switch offer % 3 {
		case 0:
			moved++
		case 2:
			kept++
		}
	}
	if res.Moved != moved || res.Stayed[handoff.StayRefused] != n-moved || len(res.Stays) != n-moved || len(res.Pauses) != moved {
		t.Errorf("moved %d, stays %v; want %d moved, %d refused", res.Moved, res.Stays, moved, n-moved)
	}
	if nu.Tunnels() != 0 || old.Tunnels() != n-moved {
		t.Errorf("carried %d tunnels here and %d in the other process after the move, want %d and none", old.Tunnels(), nu.Tunnels(), n-moved)
	}
	results := make(chan carryResult, n)
	var runs sync.WaitGroup
	var ended atomic.Int32
	m.run(&runs, results, &ended)
	if rekey && res.Moved == moved {
		// Until each moved session renewed a key, or an adopted tunnel
		// ended before its user's stream was let end: a failure, which
		// the checks below report.
		waitUntil(t, "a KeyUpdate applied by each moved user session and the moved forwarder sessions", func() bool {
			users, _ := userUpdates.counts()
			_, tunnels := tunnelUpdates.counts()
			return users >= moved && tunnels >= moved || ended.Load() > 0
		})
	}
	s.finish()
	up.Close()
	runs.Wait()
	close(results)
	ups := up.Results()
	forwardtest.ExactBothWays(t, s.users, ups)

	var carriedTo, carriedFrom int64
	endedHere, movedEnds := 0, 0
	for range n {
		r := fr.result(t)
		switch {
		case r.end == EndMoved && r.err == nil && len(r.dials) == 1 && r.dials[0] == nil:
			movedEnds++
		case r.end == EndClosed && r.err == nil && r.stats.AToB.Spliced && r.stats.BToA.Spliced:
			endedHere++
			carriedTo += r.stats.AToB.Bytes
			carriedFrom += r.stats.BToA.Bytes
		default:
			t.Errorf("Carry: end %s, %v, dials %v, %+v; want %s, or %s splicing both ways", r.end, r.err, r.dials, r.stats, EndMoved, EndClosed)
		}
	}
	adoptedEnds := 0
	for r := range results {
		if r.end != EndClosed || r.err != nil || len(r.dials) != 0 || !r.stats.AToB.Spliced || !r.stats.BToA.Spliced {
			t.Errorf("adopted Run: end %s, %v, dials %v, %+v; want %s splicing both ways, its opening reported before the move", r.end, r.err, r.dials, r.stats, EndClosed)
			continue
		}
		adoptedEnds++
		carriedTo += r.stats.AToB.Bytes
		carriedFrom += r.stats.BToA.Bytes
	}
	upTo, upFrom := forwardtest.Totals(ups)
	if movedEnds != moved || endedHere != n-moved || adoptedEnds != moved || carriedTo != upTo || carriedFrom != upFrom {
		t.Errorf("Carry ended moved %d, closed %d; adopted Runs closed %d; the tunnels counted %d bytes to and %d from the sandbox, "+
			"the sandbox received %d and sent %d; want %d, %d, %d and the same bytes", movedEnds, endedHere, adoptedEnds, carriedTo, carriedFrom, upTo, upFrom,
			moved, n-moved, moved)
	}
	// Each session handed off once; adopted once where it went (by the
	// other process, or back here), and twice when the other process
	// adopted it and then kept it where it was.
	ks := ktls.Stats()
	if ks.HandedOff-ks0.HandedOff != 2*n || ks.Adopted-ks0.Adopted != uint64(2*(n+kept)) {
		t.Errorf("ktls handed off %d sessions and adopted %d, want %d and %d", ks.HandedOff-ks0.HandedOff, ks.Adopted-ks0.Adopted, 2*n, 2*(n+kept))
	}
	// Three sessions a tunnel: the user's at the gateway, and the
	// gateway's and the forwarder's ends of theirs.
	d := kerneltest.InstalledOnce(t, stat0, 3*n)
	if rekey && (d["TlsTxRekeyOk"] == 0 || d["TlsRxRekeyOk"] == 0 || d["TlsTxRekeyError"] != 0 || d["TlsRxRekeyError"] != 0) {
		t.Errorf("tls_stat deltas %v: want keys renewed both ways, without an error", d)
	}
	if users, _ := userUpdates.counts(); rekey && (users < moved || tunnelUpdates.applied < moved) {
		t.Errorf("KeyUpdates applied after the move by %d moved user sessions and %d times by the moved forwarder sessions, want at least %d each", users, tunnelUpdates.applied, moved)
	}
	t.Logf("pauses %v; KeyUpdates applied by the moved sessions: %v (user), %v (forwarder)", res.Pauses, userUpdates.byPeer, tunnelUpdates.applied)
}

// A kernel TLS tunnel that moves before it opened (the forwarder's first
// byte not yet relayed, though its user's bytes reach the sandbox) is
// reported open once, by the process that adopted it: Carry ends it
// EndMoved having told onDial nothing, and the adopted Run tells onDial
// nil once the sandbox answers. Every byte arrives exact both ways, and
// the counts go on from the move.
func TestKernelGatewayMoveBeforeOpen(t *testing.T) {
	kerneltest.Require(t)
	const n = 2
	forwardtest.CheckLeaks(t)
	ktls.Probe() // cached for the process: its throwaway sessions stay out of the counters
	p := newPKI(t)
	gw := forwardtest.NewGateway(t, "gw-1")
	hold := make(chan struct{})
	holding := sync.OnceFunc(func() { close(hold) })
	defer holding()
	up := forwardtest.NewHeldUpstream(t, 16<<10, 2*time.Millisecond, hold)
	f := startForwarder(t, p, gw, "127.0.0.0/8")
	opts := ktls.Options{RequireOffload: true}
	old := newKTLSDialer(t, p, gw, opts, opts)
	defer old.Close()
	nu := newKTLSDialer(t, p, gw, opts, opts)
	defer nu.Close()
	fr := startFrontWith(t, p, old, Route{Forwarder: f.addr(), Sandbox: "sbx-early", Target: up.Addr()}, opts)
	stat0, err := kerneltest.ReadStat()
	if err != nil {
		t.Fatal(err)
	}

	s := openStreams(t, fr, p.client, old, up, n)
	waitUntil(t, "the sandbox's connection of each tunnel", func() bool { return up.Accepted() == n })
	if got := fr.opened.Load(); got != 0 {
		t.Fatalf("%d tunnels reported open before the sandbox sent a byte", got)
	}
	m := &adoptingMover{t: t, to: nu}
	res := old.MoveTunnels(context.Background(), m)
	if res.Moved != n || len(res.Stays) != 0 {
		t.Fatalf("moved %d, stays %v; want all %d moved", res.Moved, res.Stays, n)
	}
	results := make(chan carryResult, n)
	var runs sync.WaitGroup
	var ended atomic.Int32
	m.run(&runs, results, &ended)
	holding()
	s.finish()
	up.Close()
	runs.Wait()
	close(results)
	ups := up.Results()
	forwardtest.ExactBothWays(t, s.users, ups)

	for range n {
		if r := fr.result(t); r.end != EndMoved || r.err != nil || len(r.dials) != 0 {
			t.Errorf("Carry: end %s, %v, dials %v; want %s, onDial told nothing", r.end, r.err, r.dials, EndMoved)
		}
	}
	var carriedTo, carriedFrom int64
	for r := range results {
		if r.end != EndClosed || r.err != nil || len(r.dials) != 1 || r.dials[0] != nil || !r.stats.AToB.Spliced || !r.stats.BToA.Spliced {
			t.Errorf("adopted Run: end %s, %v, dials %v, %+v; want %s splicing both ways, reported open once", r.end, r.err, r.dials, r.stats, EndClosed)
		}
		carriedTo += r.stats.AToB.Bytes
		carriedFrom += r.stats.BToA.Bytes
	}
	upTo, upFrom := forwardtest.Totals(ups)
	if carriedTo != upTo || carriedFrom != upFrom || upFrom == 0 {
		t.Errorf("the adopted tunnels counted %d bytes to and %d from the sandbox; it received %d and sent %d", carriedTo, carriedFrom, upTo, upFrom)
	}
	kerneltest.InstalledOnce(t, stat0, 3*n)
}

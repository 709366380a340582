package forward

import (
	"context"
	"crypto/ed25519"
	"errors"
	"net"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/splicetest"
	"github.com/ktlsingress/caddy-ktls/internal/tcpfile"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

// Plain TCP gateway connections move as the descriptor alone (the kernel
// TLS session is ktls's, tested in the VM).
func tcpHandOff(c net.Conn) ([]byte, syscall.Conn, error) {
	return []byte("tcp"), c.(*net.TCPConn), nil
}

func tcpAdopt(state []byte, s syscall.Conn) (net.Conn, func(), error) {
	if string(state) != "tcp" {
		return nil, nil, errors.New("not a tcp state")
	}
	c, err := tcpfile.Conn(s)
	if err != nil {
		return nil, nil, err
	}
	return c, func() { c.Close() }, nil
}

// newProcess is a second forwarder, as the new process has it: its own
// registry, trusting the same gateway; mods change its Config.
func newProcess(t testing.TB, gw *forwardtest.Gateway, mods ...func(*Config)) (*Forwarder, *Registry) {
	t.Helper()
	v, err := preamble.NewVerifier(preamble.VerifierConfig{Keys: map[string]ed25519.PublicKey{"gw-1": gw.Pub}})
	if err != nil {
		t.Fatal(err)
	}
	pol, err := NewTargetPolicy([]string{"127.0.0.0/8"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	reg := NewRegistry()
	cfg := Config{Verifier: v, Policy: pol, Registry: reg, AdoptConn: tcpAdopt}
	for _, mod := range mods {
		mod(&cfg)
	}
	f, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return f, reg
}

// receiverSession connects a sender and a receiver, which passes each
// object offered to take until the session ends, several at once on
// goroutines of their own, as the sandbox_handoff app does
// (handoff.Receiver.Take).
func receiverSession(t testing.TB, take func(it *handoff.Item)) *handoff.Sender {
	t.Helper()
	return readSession(t, func(r *handoff.Receiver) { r.Take(take) })
}

// serialSession is a receiverSession that passes the objects to take one
// at a time, on the goroutine that reads the session: take may wait for
// its verdict (Item.Adopt).
func serialSession(t testing.TB, take func(it *handoff.Item)) *handoff.Sender {
	t.Helper()
	return readSession(t, func(r *handoff.Receiver) {
		for {
			it, err := r.Next()
			if err != nil {
				return
			}
			take(it)
		}
	})
}

// readSession connects a sender and a receiver, which read reads.
func readSession(t testing.TB, read func(r *handoff.Receiver)) *handoff.Sender {
	t.Helper()
	path := filepath.Join(t.TempDir(), "handoff.sock")
	ln, err := handoff.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	// A kernel test's VM runs every tunnel's stream and both processes on
	// one emulated CPU: an answer can take longer than the default.
	cfg := handoff.Config{Timeout: time.Minute, Window: *moveWindow}
	done := make(chan struct{})
	t.Cleanup(func() { <-done })
	go func() {
		defer close(done)
		r, err := handoff.Dial(path, cfg)
		if err != nil {
			t.Error(err)
			return
		}
		defer r.Close()
		read(r)
	}()
	s, err := handoff.Accept(ln, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// handoffSession is a receiverSession that adopts every tunnel into f
// unless refuse says no, runs the adopted ones, and sends their results to
// results.
func handoffSession(t testing.TB, f *Forwarder, refuse bool, results chan<- Result, runs *sync.WaitGroup) *handoff.Sender {
	t.Helper()
	return receiverSession(t, func(it *handoff.Item) {
		if refuse {
			it.Refuse("the test refuses every tunnel")
			return
		}
		mt, err := DecodeMovedTunnel(it.State)
		if err != nil {
			t.Errorf("moved tunnel: %v", err)
			it.Refuse(err.Error())
			return
		}
		a, err := f.Adopt(mt, it.Files)
		if err != nil {
			it.Refuse(err.Error())
			return
		}
		it.Close() // the adopted tunnel holds duplicates
		run := func() {
			runs.Go(func() {
				res, err := a.Run()
				if err != nil {
					t.Errorf("adopted tunnel %d: %v", res.Tunnel.ID, err)
				}
				results <- res
			})
		}
		if err := it.AdoptThen(run, a.Discard); err != nil {
			a.Discard()
		}
	})
}

// upgrade moves old's tunnels to nu as an upgrade does: the report stream
// first (HandOff, AdoptReports), then every tunnel through a handoff
// session (handoffSession: the adopted ones run and send their results to
// results; each one that moved has been started when it returns), and the
// stream resumes in nu. It returns what MoveTunnels did
// and how long it took.
func upgrade(t testing.TB, old *Registry, nu *Forwarder, nuReg *Registry, results chan<- Result, runs *sync.WaitGroup) (handoff.MoveResult[uint64], time.Duration) {
	t.Helper()
	st, done, err := old.HandOff()
	if err != nil {
		t.Fatal(err)
	}
	if err := nuReg.AdoptReports(st); err != nil {
		t.Fatal(err)
	}
	s := handoffSession(t, nu, false, results, runs)
	// A pause that never completes stays, canceled, and the test fails
	// naming it, rather than hanging.
	ctx, cancel := context.WithTimeout(context.Background(), streamsLimit)
	defer cancel()
	start := time.Now()
	res := old.MoveTunnels(ctx, handoff.SenderMover(s))
	took := time.Since(start)
	// The receiver's answer comes once it acted on every verdict: each
	// tunnel that moved runs.
	if err := s.Finish(); err != nil {
		t.Errorf("the handoff session's end: %v", err)
	}
	s.Close()
	// The report stream moved (nuReg adopted it), whether or not a tunnel did,
	// as the process-level handoff says once the new process took the state.
	done(true)
	nuReg.ResumeReports()
	return res, took
}

// Tunnels streaming both ways move to another forwarder mid-stream: every
// byte arrives exact both ways, the old Serve ends Moved, the adopted relay
// counts on from the old one's counters, and the report streams of the
// two registries carry every byte exactly once.
func TestMoveTunnelsMidStream(t *testing.T) {
	const n = 8
	forwardtest.CheckLeaks(t)
	old := newFixture(t, func(c *Config) { c.HandOffConn, c.AdoptConn = tcpHandOff, tcpAdopt })
	up := forwardtest.NewPacedUpstream(t, 16<<10, 2*time.Millisecond)
	nu, nuReg := newProcess(t, old.gw)

	clients, wg, release := openStreams(t, old, up, "sbx-move", n)
	first, _ := old.reg.TakeReport("fwd")

	results := make(chan Result, n)
	var runs sync.WaitGroup
	res, _ := upgrade(t, old.reg, nu, nuReg, results, &runs)
	if res.Moved != n || len(res.Stayed) != 0 {
		t.Fatalf("moved %d, stayed %v (%v); want all %d moved", res.Moved, res.Stayed, res.Stays, n)
	}
	if open, _ := old.reg.Counts(); open != 0 {
		t.Errorf("%d tunnels open in the old registry after the move", open)
	}

	release()
	wg.Wait()
	up.Close()
	runs.Wait()
	close(results)
	ups := up.Results()
	forwardtest.ExactBothWays(t, clients, ups)
	var movedTo, movedFrom int64
	for _, r := range old.wait(t, n) {
		if r != nil {
			t.Errorf("old Serve: %v", r)
		}
	}
	for _, r := range old.res {
		if !r.Moved {
			t.Errorf("old Serve of tunnel %d: not Moved", r.Tunnel.ID)
		}
	}
	var adopted int
	for r := range results {
		adopted++
		movedTo += r.Relay.AToB.Bytes
		movedFrom += r.Relay.BToA.Bytes
	}
	upTo, upFrom := forwardtest.Totals(ups)
	if adopted != n || movedTo != upTo || movedFrom != upFrom {
		t.Errorf("adopted %d tunnels counting %d bytes to and %d from the sandbox; the upstream received %d and sent %d",
			adopted, movedTo, movedFrom, upTo, upFrom)
	}
	// Every byte in exactly one report: the stream's first report (old),
	// its next (new), and the old process's stream of its own.
	next, _ := nuReg.TakeReport("fwd")
	own, _ := old.reg.TakeReport("fwd")
	to, from := reportedBytes(first, next, own)
	if to != upTo || from != upFrom || next.Sequence != first.Sequence+1 || next.ProcessStart != first.ProcessStart {
		t.Errorf("reports carry %d bytes to and %d from the sandbox, want %d and %d; the new process's report is %+v after %+v",
			to, from, upTo, upFrom, next.ReportID, first.ReportID)
	}
}

// A tunnel the other process refuses stays and runs on exact.
func TestMoveTunnelsRefusedStay(t *testing.T) {
	const n = 4
	forwardtest.CheckLeaks(t)
	old := newFixture(t, func(c *Config) { c.HandOffConn, c.AdoptConn = tcpHandOff, tcpAdopt })
	up := forwardtest.NewPacedUpstream(t, 16<<10, 2*time.Millisecond)
	nu, _ := newProcess(t, old.gw)
	clients, wg, release := openStreams(t, old, up, "sbx-stay", n)
	results := make(chan Result, n)
	var runs sync.WaitGroup
	s := handoffSession(t, nu, true, results, &runs)
	res := old.reg.MoveTunnels(context.Background(), handoff.SenderMover(s))
	s.Close()
	if res.Moved != 0 || res.Stayed[handoff.StayRefused] != n {
		t.Fatalf("moved %d, stayed %v (%v); want all %d refused", res.Moved, res.Stayed, res.Stays, n)
	}
	release()
	wg.Wait()
	up.Close()
	runs.Wait()
	for i, r := range old.wait(t, n) {
		if r != nil || old.res[i].Moved {
			t.Errorf("tunnel %d: %v, moved %v", old.res[i].Tunnel.ID, r, old.res[i].Moved)
		}
	}
	forwardtest.ExactBothWays(t, clients, up.Results())
}

// reportedBytes sums the bytes to and from the sandboxes over reports.
func reportedBytes(reports ...ActivityReport) (to, from int64) {
	for _, rep := range reports {
		for _, d := range rep.Sandboxes {
			to += d.BytesToSandbox
			from += d.BytesFromSandbox
		}
	}
	return to, from
}

// openStreams opens n streaming tunnels to sandbox through old's
// forwarder and waits until each moves bytes; release lets them finish
// (at most once: the test's cleanup releases them too, so that a test
// that fails first does not wait for streams that never end), and wg
// waits for them. A failed test logs old's Serve errors.
func openStreams(t *testing.T, old *fixture, up *forwardtest.Upstream, sandbox string, n int) ([]*forwardtest.Stream, *sync.WaitGroup, func()) {
	t.Helper()
	clients := make([]*forwardtest.Stream, n)
	wg := new(sync.WaitGroup)
	startCh, releaseCh := make(chan struct{}), make(chan struct{})
	start, release := sync.OnceFunc(func() { close(startCh) }), sync.OnceFunc(func() { close(releaseCh) })
	t.Cleanup(func() {
		start()
		release()
		if t.Failed() {
			old.mu.Lock()
			t.Logf("the old forwarder's Serve errors so far: %v", old.errs)
			old.mu.Unlock()
		}
	})
	for i := range n {
		c, frame := old.dial(t), old.gw.Frame(t, sandbox, up.Addr())
		wg.Go(func() { clients[i] = forwardtest.RunStream(c, frame, uint64(i+1), startCh, releaseCh) })
	}
	waitStreaming(t, old.reg, up, n, start)
	return clients, wg, release
}

// waitStreaming waits for n tunnels open in reg, starts their streams and
// waits for bytes of each to have reached up.
func waitStreaming(t *testing.T, reg *Registry, up *forwardtest.Upstream, n int, start func()) {
	t.Helper()
	waitUntil(t, "every tunnel open", func() bool { open, _ := reg.Counts(); return open == n })
	start()
	waitUntil(t, "bytes moving", func() bool { return up.Received() > int64(n)*64<<10 })
}

func waitUntil(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// Tunnels whose streams end while they move (each sends its last chunks
// and half-closes; the upstream then ends too): whichever step each
// tunnel's end meets (a direction ended before its pause, the relay
// ending under it, the tunnel gone before its turn), every byte arrives
// exact both ways, every tunnel ends in order in exactly one process
// (moved, then ended there, or ended in the old one), and the reports of
// the two registries carry every byte exactly once.
func TestMoveTunnelsWhileTheyEnd(t *testing.T) {
	for _, ms := range []time.Duration{50, 65, 80} {
		delay := ms * time.Millisecond
		t.Run(delay.String(), func(t *testing.T) {
			const n = 12
			forwardtest.CheckLeaks(t)
			old := newFixture(t, func(c *Config) {
				c.HandOffConn = func(c net.Conn) ([]byte, syscall.Conn, error) { return tcpHandOff(c.(splicetest.RecordCloser).TCPConn) }
				c.AdoptConn = tcpAdopt
			})
			wrap := func(c net.Conn) net.Conn { return splicetest.RecordCloser{TCPConn: c.(*net.TCPConn)} }
			old.wrap.Store(&wrap)
			up := forwardtest.NewPacedUpstream(t, 16<<10, 2*time.Millisecond)
			nu, nuReg := newProcess(t, old.gw)
			clients, wg, release := openStreams(t, old, up, "sbx-ending", n)
			first, _ := old.reg.TakeReport("fwd")

			// Each stream sends 32 chunks more, 2 ms apart, and ends:
			// the move begins around their ends.
			release()
			time.Sleep(delay)
			results := make(chan Result, n)
			var runs sync.WaitGroup
			res, _ := upgrade(t, old.reg, nu, nuReg, results, &runs)
			wg.Wait()
			up.Close()
			runs.Wait()
			close(results)
			ups := up.Results()
			forwardtest.ExactBothWays(t, clients, ups)

			// Each tunnel's last relay counts all its bytes: the
			// adopted one from the paused one's counters on.
			var countedTo, countedFrom int64
			moved := 0
			for i, r := range old.wait(t, n) {
				if r != nil {
					t.Errorf("old Serve of tunnel %d: %v", old.res[i].Tunnel.ID, r)
				}
				if old.res[i].Moved {
					moved++
				} else {
					countedTo += old.res[i].Relay.AToB.Bytes
					countedFrom += old.res[i].Relay.BToA.Bytes
				}
			}
			adopted := 0
			for r := range results {
				adopted++
				countedTo += r.Relay.AToB.Bytes
				countedFrom += r.Relay.BToA.Bytes
				for _, ds := range []struct {
					name string
					end  string
				}{{"to", r.Relay.AToB.End.String()}, {"from", r.Relay.BToA.End.String()}} {
					if ds.end != "eof" {
						t.Errorf("adopted tunnel %d: %s the sandbox ended %s, want eof", r.Tunnel.ID, ds.name, ds.end)
					}
				}
			}
			if moved != res.Moved || adopted != res.Moved {
				t.Errorf("MoveTunnels says %d moved (stayed %v); the old process's Serve says %d, the new one adopted %d", res.Moved, res.Stayed, moved, adopted)
			}
			upTo, upFrom := forwardtest.Totals(ups)
			if countedTo != upTo || countedFrom != upFrom {
				t.Errorf("the tunnels' last relays count %d bytes to and %d from the sandbox, want %d and %d", countedTo, countedFrom, upTo, upFrom)
			}
			next, _ := nuReg.TakeReport("fwd")
			own, _ := old.reg.TakeReport("fwd")
			to, from := reportedBytes(first, next, own)
			if to != upTo || from != upFrom {
				t.Errorf("reports carry %d bytes to and %d from the sandbox, want %d and %d", to, from, upTo, upFrom)
			}
			t.Logf("moved %d of %d, stayed %v", res.Moved, n, res.Stayed)
		})
	}
}

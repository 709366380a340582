package forward

import (
	"crypto/ed25519"
	"encoding/json"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/wire"
)

// viaJSON is st as it arrives in the other process.
func viaJSON[T any](t *testing.T, st T) T {
	t.Helper()
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var out T
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	return out
}

// viaWire returns s as the other process decodes it.
func viaWire(t *testing.T, s TunnelState) TunnelState {
	t.Helper()
	w := wire.NewWriter(1, 0)
	s.write(w)
	r := wire.NewReader(w.B)
	r.Version()
	out := readTunnelState(r)
	if err := r.End(); err != nil {
		t.Fatal(err)
	}
	return out
}

// reportTotals sums the deltas of rep by sandbox, and returns the totals
// it states.
func reportTotals(rep ActivityReport) (deltas, totals map[string][2]int64) {
	deltas, totals = map[string][2]int64{}, map[string][2]int64{}
	for _, d := range rep.Sandboxes {
		deltas[d.Sandbox] = [2]int64{d.BytesToSandbox, d.BytesFromSandbox}
		totals[d.Sandbox] = [2]int64{d.TotalBytesToSandbox, d.TotalBytesFromSandbox}
	}
	return deltas, totals
}

// The report stream moves with the tunnels: the new process's next report
// is the stream's next sequence number, its totals go on from the old
// process's, and every byte is in exactly one report of one of the two
// streams; the old process starts a stream of its own for the tunnel it
// kept.
func TestHandOffReportStream(t *testing.T) {
	pub, _, _ := ed25519.GenerateKey(nil)
	old := NewRegistry()
	origin := Origin{Peer: "10.0.0.9:5555", Certificate: "CN=gw-1", KeyID: "k1", key: pub, names: []string{"gw-1"}}
	moveA, _, _ := old.Open("sbx-a", "10.1.0.1:80", origin, 0)
	moveB, _, _ := old.Open("sbx-b", "10.1.0.2:80", origin, 0)
	stay, _, _ := old.Open("sbx-a", "10.1.0.1:81", origin, 0)
	moveA.AddToSandbox(100)
	moveA.AddFromSandbox(1000)
	moveB.AddToSandbox(7)
	first, ok := old.TakeReport("fwd")
	if !ok || first.Sequence != 1 {
		t.Fatalf("first report: %v, sequence %d", ok, first.Sequence)
	}
	moveA.AddToSandbox(20) // reported by the new process
	stay.AddFromSandbox(3)

	st, done, err := old.HandOff()
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := old.HandOff(); err != ErrHandingOff {
		t.Fatalf("a second HandOff meanwhile: %v, want ErrHandingOff", err)
	}
	if _, ok := old.TakeReport("fwd"); ok {
		t.Fatal("the old registry took a report while its stream was being handed off")
	}
	stay.AddToSandbox(5) // after the export: the old process's new stream
	moved := []TunnelState{viaWire(t, moveA.State()), viaWire(t, moveB.State())}
	moveA.Close()
	moveB.Close()
	done(true)

	nu := NewRegistry()
	if err := nu.AdoptReports(viaJSON(t, st)); err != nil {
		t.Fatal(err)
	}
	var adopted []*Tunnel
	for _, s := range moved {
		tun, _, err := nu.AdoptTunnel(s)
		if err != nil {
			t.Fatal(err)
		}
		adopted = append(adopted, tun)
	}
	if got := adopted[0].Info(); got.ID != moveA.ID || got.BytesToSandbox != 120 || got.BytesFromSandbox != 1000 || got.KeyID != "k1" || !got.Opened.Equal(moveA.Opened) {
		t.Errorf("moved tunnel A: %+v", got)
	}
	adopted[0].AddFromSandbox(4000)
	adopted[1].AddToSandbox(1)
	if _, ok := nu.TakeReport("fwd"); ok {
		t.Fatal("the new registry took a report before the handoff ended (ResumeReports)")
	}
	nu.ResumeReports()

	next, ok := nu.TakeReport("fwd")
	if !ok || next.Sequence != 2 || !next.ProcessStart.Equal(first.ProcessStart) || next.ID != "fwd/"+itoa64(first.ProcessStart.UnixNano())+"/2" {
		t.Fatalf("the new process's first report: ok %v, %+v; want sequence 2 of stream %s", ok, next.ReportID, first.ID)
	}
	deltas, totals := reportTotals(next)
	// sbx-a: 20 to (moved tunnel, before the export) and 3 from (the
	// kept one, before it); 4000 from after. sbx-b: 1 after.
	if deltas["sbx-a"] != [2]int64{20, 4003} || totals["sbx-a"] != [2]int64{120, 5003} || deltas["sbx-b"] != [2]int64{1, 0} || totals["sbx-b"] != [2]int64{8, 0} {
		t.Errorf("new process's report: deltas %v, totals %v", deltas, totals)
	}
	oldNext, ok := old.TakeReport("fwd")
	if !ok || oldNext.Sequence != 1 || oldNext.ProcessStart.Equal(first.ProcessStart) {
		t.Fatalf("the old process's report after the handoff: ok %v, %+v; want sequence 1 of a new stream", ok, oldNext.ReportID)
	}
	deltas, totals = reportTotals(oldNext)
	if deltas["sbx-a"] != [2]int64{5, 0} || totals["sbx-a"] != [2]int64{5, 0} || len(deltas) != 1 {
		t.Errorf("old process's report: deltas %v, totals %v; want sbx-a's 5 bytes after the export only", deltas, totals)
	}
	if open, _ := nu.Counts(); open != 2 {
		t.Errorf("new registry: %d tunnels open, want the 2 moved", open)
	}
	for _, a := range nu.Activity() {
		if a.Sandbox == "sbx-a" && (a.OpenTunnels != 1 || a.TotalTunnels != 2) {
			t.Errorf("new registry's sbx-a: %d open, %d total; want 1 and 2", a.OpenTunnels, a.TotalTunnels)
		}
	}
	fresh, _, err := nu.Open("sbx-c", "10.1.0.3:80", Origin{}, 0)
	if err != nil || fresh.ID <= moveB.ID || fresh.ID <= stay.ID {
		t.Errorf("a new tunnel after the adoption: %v, ID %d; want one above the old process's (%d)", err, fresh.ID, stay.ID)
	}
	// The signing key moved: revoking it ends the moved tunnels only.
	if n := nu.Revoke(func(_ string, key ed25519.PublicKey) bool { return !pub.Equal(key) }); n != 2 {
		t.Errorf("revoking the moved tunnels' key ended %d tunnels, want 2", n)
	}
}

func itoa64(n int64) string { b, _ := json.Marshal(n); return string(b) }

// A handoff that fails leaves the stream where it was: the reports go on
// with every byte, those counted meanwhile included, and those of a tunnel
// that moved to a process that then died (closed here when it moved).
func TestHandOffAborted(t *testing.T) {
	reg := NewRegistry()
	tun, _, _ := reg.Open("sbx", "10.1.0.1:80", Origin{}, 0)
	gone, _, _ := reg.Open("sbx", "10.1.0.2:80", Origin{}, 0)
	tun.AddToSandbox(10)
	gone.AddFromSandbox(7)
	_, done, err := reg.HandOff()
	if err != nil {
		t.Fatal(err)
	}
	tun.AddToSandbox(5)
	gone.Close()
	done(false)
	rep, ok := reg.TakeReport("fwd")
	deltas, totals := reportTotals(rep)
	if !ok || rep.Sequence != 1 || deltas["sbx"] != [2]int64{15, 7} || totals["sbx"] != [2]int64{15, 7} {
		t.Errorf("after an aborted handoff: ok %v, sequence %d, deltas %v, totals %v", ok, rep.Sequence, deltas, totals)
	}
	if open, _ := reg.Counts(); open != 1 {
		t.Errorf("%d tunnels open after an aborted handoff, want the one that stayed", open)
	}
	if _, _, err := reg.HandOff(); err != nil {
		t.Errorf("a handoff after an aborted one: %v", err)
	}
}

// The tunnels the old process opens after a handoff (the connections it
// accepted before the switch) and the new process's never share an ID;
// one opened between the export and the move keeps its ID as it moves.
func TestHandOffLeavesIDsToTheOldProcess(t *testing.T) {
	old := NewRegistry()
	first, _, _ := old.Open("sbx", "10.1.0.1:80", Origin{}, 0)
	st, done, err := old.HandOff()
	if err != nil {
		t.Fatal(err)
	}
	between, _, err := old.Open("sbx", "10.1.0.1:80", Origin{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	nu := NewRegistry()
	if err := nu.AdoptReports(viaJSON(t, st)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := nu.AdoptTunnel(first.State()); err != nil {
		t.Fatalf("the tunnel open at the export: %v", err)
	}
	if _, _, err := nu.AdoptTunnel(between.State()); err != nil {
		t.Fatalf("the tunnel opened between the export and its move (ID %d): %v", between.ID, err)
	}
	done(true)
	nu.ResumeReports()
	late, _, err := old.Open("sbx", "10.1.0.1:80", Origin{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	next, _, err := nu.Open("sbx", "10.1.0.1:80", Origin{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if late.ID <= between.ID || late.ID >= next.ID || next.ID != st.NextTunnelID+1 {
		t.Errorf("IDs: %d and %d moved, %d opened late in the old process, %d first in the new one (stream ends the old IDs at %d); want them all distinct, the new process's after NextTunnelID",
			first.ID, between.ID, late.ID, next.ID, st.NextTunnelID)
	}
}

// Close's refusals move; a registry that opened a tunnel adopts nothing,
// nor a state of another version; a tunnel outside the adopted stream is
// refused.
func TestAdoptReportsRefusals(t *testing.T) {
	old := NewRegistry()
	tun, _, _ := old.Open("sbx", "10.1.0.1:80", Origin{}, 0)
	if _, err := old.Close(CloseRequest{Sandbox: "sbx", RefuseFor: time.Hour}); err != nil {
		t.Fatal(err)
	}
	tun.Close()
	st, done, _ := old.HandOff()
	done(true)

	nu := NewRegistry()
	if err := nu.AdoptReports(viaJSON(t, st)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := nu.Open("sbx", "10.1.0.1:80", Origin{}, 0); ReasonOf(err) != string(ReasonSandboxClosed) {
		t.Errorf("a tunnel to the closed sandbox after the move: %v, want %s", err, ReasonSandboxClosed)
	}
	if _, _, err := nu.AdoptTunnel(TunnelState{ID: st.NextTunnelID + 1, Sandbox: "sbx"}); err == nil {
		t.Error("a moved tunnel with an ID the stream never gave was adopted")
	}
	if _, _, err := nu.AdoptTunnel(TunnelState{ID: 1, Sandbox: "other"}); err == nil {
		t.Error("a moved tunnel of a sandbox the stream does not hold was adopted")
	}

	used := NewRegistry()
	used.Open("sbx-x", "10.1.0.1:80", Origin{}, 0)
	if err := used.AdoptReports(st); err == nil {
		t.Error("a registry that opened a tunnel adopted a report stream")
	}
	st.Version++
	if err := NewRegistry().AdoptReports(st); err == nil {
		t.Error("a report state of another version was adopted")
	}
}

// The bandwidth buckets move with what they held: the old process's are
// empty after the export (the two never grant more than one would), the
// new process's first tunnel of the sandbox gets exactly the rest; an
// aborted handoff gives the tokens back.
func TestHandOffBandwidthBuckets(t *testing.T) {
	const burst = 64 << 10
	capped := Bandwidth{BytesPerSecond: 1, Burst: burst} // refills nothing within a test
	old := NewRegistry()
	lim, release := old.limits("sbx", capped, Bandwidth{})
	defer release()
	if n, _ := lim[0].Grant(burst - 20000); n != burst-20000 {
		t.Fatalf("granted %d", n)
	}
	st, done, err := old.HandOff()
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Buckets) != 1 || st.Buckets[0].Tokens != 20000 || st.Buckets[0].Sandbox != "sbx" {
		t.Fatalf("exported buckets %+v, want sbx's with 20000 tokens", st.Buckets)
	}
	if n, _ := lim[0].Grant(1 << 20); n != 0 {
		t.Errorf("the old bucket granted %d after the export, want 0", n)
	}
	done(false)
	if n, _ := lim[0].Grant(1 << 20); n != 20000 {
		t.Errorf("after an aborted handoff the old bucket granted %d, want the 20000 back", n)
	}
	lim[0].Refund(20000)

	st, done, _ = old.HandOff()
	done(true)
	nu := NewRegistry()
	if err := nu.AdoptReports(viaJSON(t, st)); err != nil {
		t.Fatal(err)
	}
	newLim, newRelease := nu.limits("sbx", capped, Bandwidth{})
	defer newRelease()
	if n, _ := newLim[0].Grant(1 << 20); n != 20000 {
		t.Errorf("the moved bucket granted %d, want the 20000 it held", n)
	}
	other, otherRelease := nu.limits("sbx-other", capped, Bandwidth{})
	defer otherRelease()
	if n, _ := other[0].Grant(1 << 20); n != burst {
		t.Errorf("another sandbox's new bucket granted %d, want a full %d", n, burst)
	}
}

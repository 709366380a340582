package forward

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"
)

// Close ends exactly the selected tunnels with a *ClosedError cause,
// counts them, refuses the sandbox until RefuseFor has passed (a shorter
// later refusal does not shorten it), and rejects requests naming nothing,
// both, a negative duration, or a refusal for a certificate.
func TestRegistryClose(t *testing.T) {
	reg := NewRegistry()
	a, actx, _ := reg.Open("sbx-a", "10.0.0.1:1", Origin{Certificate: "CN=gw-1", names: []string{"gw-1"}}, 0)
	b, bctx, _ := reg.Open("sbx-b", "10.0.0.1:1", Origin{Certificate: "CN=gw-2", names: []string{"gw-2", "gw-2.example"}}, 0)
	defer a.Close()
	defer b.Close()
	for _, bad := range []CloseRequest{{}, {Sandbox: "sbx-a", Certificate: "gw-1"}, {Sandbox: "sbx-a", Grace: -1},
		{Certificate: "gw-1", RefuseFor: time.Second}} {
		if _, err := reg.Close(bad); err == nil {
			t.Errorf("Close(%+v) accepted", bad)
		}
	}
	if actx.Err() != nil || bctx.Err() != nil || reg.Closed() != 0 {
		t.Fatal("a refused close ended a tunnel")
	}
	res, err := reg.Close(CloseRequest{Certificate: "gw-2.example"})
	if err != nil || len(res.Tunnels) != 1 || res.Tunnels[0].ID != b.ID {
		t.Fatalf("close by DNS name: %+v, %v", res, err)
	}
	var ce *ClosedError
	if !errors.As(context.Cause(bctx), &ce) || ce.Certificate != "gw-2.example" || actx.Err() != nil {
		t.Errorf("b's cause %v, a's %v: want b closed, a open", context.Cause(bctx), actx.Err())
	}
	// Long enough that a loaded machine reaches the checks below within it.
	res, err = reg.Close(CloseRequest{Sandbox: "sbx-a", RefuseFor: 2 * time.Second})
	if err != nil || len(res.Tunnels) != 1 || res.RefusingUntil.IsZero() || reg.Closed() != 2 {
		t.Fatalf("close sbx-a: %+v, %v, closed %d", res, err, reg.Closed())
	}
	if res2, _ := reg.Close(CloseRequest{Sandbox: "sbx-a", RefuseFor: time.Millisecond}); !res2.RefusingUntil.Equal(res.RefusingUntil) {
		t.Errorf("a shorter refusal moved the end from %v to %v", res.RefusingUntil, res2.RefusingUntil)
	}
	if _, _, err := reg.Open("sbx-a", "10.0.0.1:1", Origin{}, 0); ReasonOf(err) != string(ReasonSandboxClosed) {
		t.Errorf("Open during the refusal: %v, want %s", err, ReasonSandboxClosed)
	}
	if err := reg.checkAdmit("sbx-b", 0); err != nil {
		t.Errorf("another sandbox refused: %v", err)
	}
	time.Sleep(time.Until(res.RefusingUntil))
	c, _, err := reg.Open("sbx-a", "10.0.0.1:1", Origin{}, 0)
	if err != nil {
		t.Fatalf("Open after the refusal: %v", err)
	}
	c.Close()
	if r := reg.Refusals(); len(r) != 0 {
		t.Errorf("refusals after expiry: %v", r)
	}
}

// A graceful close leaves the tunnels open for the grace period, then ends
// those still open and reports them.
func TestRegistryCloseGraceful(t *testing.T) {
	reg := NewRegistry()
	done, _, _ := reg.Open("sbx", "10.0.0.1:1", Origin{}, 0)
	left, lctx, _ := reg.Open("sbx", "10.0.0.1:1", Origin{}, 0)
	defer left.Close()
	ended := make(chan []TunnelInfo, 1)
	res, err := reg.Close(CloseRequest{Sandbox: "sbx", Grace: 50 * time.Millisecond, OnGraceEnd: func(e []TunnelInfo) { ended <- e }})
	if err != nil || len(res.Tunnels) != 2 || res.Deadline.IsZero() {
		t.Fatalf("%+v, %v", res, err)
	}
	done.Close()
	if lctx.Err() != nil {
		t.Fatal("ended before the grace period")
	}
	e := <-ended
	if len(e) != 1 || e[0].ID != left.ID || lctx.Err() == nil || reg.Closed() != 1 {
		t.Errorf("grace end: %+v, ctx %v, closed %d; want only the tunnel left open ended", e, lctx.Err(), reg.Closed())
	}
	// A tunnel a close ended, still registered while its relay winds down,
	// is not ended (nor counted) again.
	again, _, _ := reg.Open("sbx", "10.0.0.1:1", Origin{}, 0)
	defer again.Close()
	if _, err := reg.Close(CloseRequest{Sandbox: "sbx", Grace: 10 * time.Millisecond, OnGraceEnd: func(e []TunnelInfo) { ended <- e }}); err != nil {
		t.Fatal(err)
	}
	reg.Close(CloseRequest{Sandbox: "sbx"})
	if e := <-ended; len(e) != 0 || reg.Closed() != 2 {
		t.Errorf("the grace end after a fail close reported %+v, closed %d; want none and 2 (the first close's and the new tunnel)", e, reg.Closed())
	}
}

// Reports are numbered from 1 with consecutive sequences; each sandbox's
// totals are the sum of its deltas, so a lost report's bytes are the
// difference of the totals around it; a sandbox's last entry says no tunnel
// is open.
func TestRegistryTakeReport(t *testing.T) {
	reg := NewRegistry()
	if _, ok := reg.TakeReport("fwd"); ok {
		t.Fatal("a report with nothing to say")
	}
	tun, _, _ := reg.Open("sbx", "10.0.0.1:1", Origin{}, 0)
	var reps []ActivityReport
	for i := range 3 {
		tun.AddToSandbox(int64(100 * (i + 1)))
		tun.AddFromSandbox(7)
		rep, ok := reg.TakeReport("fwd")
		if !ok {
			t.Fatal("no report")
		}
		reps = append(reps, rep)
	}
	// The last tunnel closed after its bytes were taken: one more entry
	// says so, with zero deltas and the same totals; then nothing.
	tun.Close()
	if rep, ok := reg.TakeReport("fwd"); !ok || len(rep.Sandboxes) != 1 || rep.Sandboxes[0].OpenTunnels != 0 ||
		rep.Sandboxes[0].BytesToSandbox != 0 || rep.Sandboxes[0].TotalBytesToSandbox != 600 {
		t.Errorf("after the last tunnel closed: %+v, %v; want one entry with open_tunnels 0, no bytes, totals 600", rep, ok)
	}
	if rep, ok := reg.TakeReport("fwd"); ok {
		t.Errorf("a report after the close was reported: %+v", rep)
	}
	for i, rep := range reps {
		d := rep.Sandboxes[0]
		if rep.Sequence != uint64(i+1) || rep.ID != "fwd/"+strconv.FormatInt(reg.Started().UnixNano(), 10)+"/"+strconv.Itoa(i+1) || d.BytesToSandbox != int64(100*(i+1)) {
			t.Errorf("report %d: %+v", i, rep)
		}
	}
	// Report 2 lost: its bytes are report 3's totals less report 1's.
	if lost := reps[2].Sandboxes[0].TotalBytesToSandbox - reps[0].Sandboxes[0].TotalBytesToSandbox - reps[2].Sandboxes[0].BytesToSandbox; lost != 200 {
		t.Errorf("recovered %d bytes of the lost report, want 200", lost)
	}
	if got := reps[2].Sandboxes[0]; got.TotalBytesToSandbox != 600 || got.TotalBytesFromSandbox != 21 {
		t.Errorf("totals %+v, want 600/21", got)
	}
	if last := reg.LastReport(); last.Sequence != 4 {
		t.Errorf("LastReport %+v, want sequence 4 (the close's)", last)
	}
}

// At most MaxRefusals sandboxes are refused at once: one more is refused
// with a *RefusalsFullError naming the bound, before its tunnels are ended;
// lengthening a refusal already held passes at the bound; a refusal whose
// period has ended frees its place.
func TestRegistryCloseRefusalBound(t *testing.T) {
	reg := NewRegistry()
	for i := range MaxRefusals - 1 {
		if _, err := reg.Close(CloseRequest{Sandbox: "sbx-" + strconv.Itoa(i), RefuseFor: time.Hour}); err != nil {
			t.Fatalf("refusal %d: %v", i, err)
		}
	}
	short, err := reg.Close(CloseRequest{Sandbox: "sbx-short", RefuseFor: 2 * time.Second})
	if err != nil {
		t.Fatalf("refusal %d: %v", MaxRefusals, err)
	}
	over, ctx, _ := reg.Open("sbx-over", "10.0.0.1:1", Origin{}, 0)
	defer over.Close()
	_, err = reg.Close(CloseRequest{Sandbox: "sbx-over", RefuseFor: time.Minute})
	full, ok := errors.AsType[*RefusalsFullError](err)
	if !ok || full.Max != MaxRefusals || full.Sandbox != "sbx-over" ||
		err.Error() != "sandbox sbx-over cannot be refused: 4096 sandboxes are refused already, the most at once; a place frees when a refusal's period ends" {
		t.Fatalf("close beyond the bound: %v, want a *RefusalsFullError", err)
	}
	if ctx.Err() != nil || reg.Closed() != 0 || len(reg.Refusals()) != MaxRefusals {
		t.Errorf("the refused close ended a tunnel (%v, closed %d) or changed the refusals (%d)", ctx.Err(), reg.Closed(), len(reg.Refusals()))
	}
	if _, err := reg.Close(CloseRequest{Sandbox: "sbx-7", RefuseFor: 2 * time.Hour}); err != nil {
		t.Errorf("lengthening a refusal at the bound: %v", err)
	}
	time.Sleep(time.Until(short.RefusingUntil) + time.Millisecond) // sbx-short's refusal ends
	res, err := reg.Close(CloseRequest{Sandbox: "sbx-over", RefuseFor: time.Minute})
	if err != nil || len(res.Tunnels) != 1 || res.RefusingUntil.IsZero() || len(reg.Refusals()) != MaxRefusals {
		t.Errorf("close once a place freed: %+v, %v, %d refused", res, err, len(reg.Refusals()))
	}
}

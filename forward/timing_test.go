package forward

import (
	"sync"
	"testing"
	"time"

	"github.com/ktlsingress/caddy-ktls/forward/forwardtest"
)

// stepLog collects what Config.OnStep reports, from any goroutine.
type stepLog struct {
	mu    sync.Mutex
	steps []Step
	durs  []time.Duration
}

func (l *stepLog) observe(s Step, d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.steps, l.durs = append(l.steps, s), append(l.durs, d)
}

func (l *stepLog) seen() ([]Step, []time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]Step(nil), l.steps...), append([]time.Duration(nil), l.durs...)
}

// TestServeTimesSteps: a tunnel that runs reports its preamble
// verification then its dial to Config.OnStep, each with a duration, and
// Serve returns how long it lived (at least as long as the client held it
// open); a refused preamble reports its verification and no dial, and
// Serve returns no duration.
func TestServeTimesSteps(t *testing.T) {
	var log stepLog
	up := forwardtest.NewUpstream(t, 10)
	f := newFixture(t, func(c *Config) { c.OnStep = log.observe })

	const hold = 200 * time.Millisecond
	c := f.dial(t)
	if _, err := c.Write(f.gw.Frame(t, "sbx-timed", up.Addr())); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 1)); err != nil { // the tunnel is open: the target answered
		t.Fatal(err)
	}
	time.Sleep(hold)
	c.Close()
	if errs := f.wait(t, 1); len(errs) != 1 {
		t.Fatalf("Serve errors %v", errs)
	}
	steps, durs := log.seen()
	if len(steps) != 2 || steps[0] != StepPreambleVerify || steps[1] != StepDial || durs[0] <= 0 || durs[1] <= 0 {
		t.Fatalf("steps %v (durations %v), want preamble-verify then dial, each > 0", steps, durs)
	}
	if d := f.res[0].Duration; d < hold || d > 30*time.Second {
		t.Errorf("Result.Duration %v, want at least the %v the client held the tunnel open", d, hold)
	}

	other := forwardtest.NewGateway(t, "gw-1") // the right key ID, the wrong key: bad-signature
	c = f.dial(t)
	if _, err := c.Write(other.Frame(t, "sbx-timed", up.Addr())); err != nil {
		t.Fatal(err)
	}
	errs := f.wait(t, 2)
	c.Close()
	if ReasonOf(errs[1]) != "bad-signature" {
		t.Fatalf("Serve: %v, want a bad-signature refusal", errs[1])
	}
	steps, durs = log.seen()
	if len(steps) != 3 || steps[2] != StepPreambleVerify || durs[2] <= 0 {
		t.Errorf("steps %v (durations %v), want one more preamble-verify and no dial", steps, durs)
	}
	if f.res[1].Duration != 0 {
		t.Errorf("refused tunnel's Result.Duration %v, want 0", f.res[1].Duration)
	}
}

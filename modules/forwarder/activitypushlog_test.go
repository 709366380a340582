package forwarder

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ktlsingress/caddy-ktls/forward"
)

// A pushDropLog logs the first drop at once; the drops after it wait for
// the next line, at most every later, which counts them by reason; stop
// logs what waits. Every line names the receiver, the last report dropped
// and the control plane's answer to it.
func TestPushDropLog(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	l := newPushDropLog(zap.New(core), "http://cp/activity")
	// Long enough that the two drops after the first, and the check that
	// they wait, come within it on a loaded machine.
	l.every = time.Second
	answer := errors.New(`activity pusher: http://cp/activity answered 503 Service Unavailable: "quota exceeded"`)
	drop := func(seq uint64, reason string, attempts int, err error) {
		l.drop(forward.Drop{Report: forward.ReportID{ID: fmt.Sprintf("fwd/1/%d", seq), Sequence: seq}, Reason: reason, Attempts: attempts, Err: err})
	}
	lines := func() []map[string]any {
		var out []map[string]any
		for _, e := range logs.All() {
			if e.Level != zapcore.WarnLevel || e.Message != PushDropMsg {
				t.Errorf("a line %s %q, want WARN %q", e.Level, e.Message, PushDropMsg)
			}
			out = append(out, e.ContextMap())
		}
		return out
	}
	check := func(l map[string]any, want map[string]any) {
		t.Helper()
		for k, v := range want {
			if fmt.Sprint(l[k]) != fmt.Sprint(v) {
				t.Errorf("line %v: %s = %v, want %v", l, k, l[k], v)
			}
		}
	}

	drop(1, forward.DropAttempts, 4, answer)
	if got := lines(); len(got) != 1 {
		t.Fatalf("%d lines after the first drop, want 1 at once", len(got))
	} else {
		check(got[0], map[string]any{"first": true, "url": "http://cp/activity", "dropped": 1, "attempts": 1, "last_report": "fwd/1/1",
			"last_reason": "attempts", "last_attempts": 4, "last_answer": answer.Error()})
	}
	drop(2, forward.DropAttempts, 4, answer)
	drop(3, forward.DropQueueFull, 0, nil)
	if n := len(lines()); n != 1 {
		t.Errorf("%d lines right after two more drops, want still 1: they wait for the next line", n)
	}
	for deadline := time.Now().Add(5 * time.Second); len(logs.All()) != 2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("gave up waiting for the summary of the drops that waited")
		}
	}
	got := lines()
	check(got[1], map[string]any{"dropped": 2, "attempts": 1, "queue-full": 1, "last_report": "fwd/1/3", "last_reason": "queue-full", "last_attempts": 0})
	if _, ok := got[1]["first"]; ok || got[1]["since_last_line"] == nil || got[1]["last_answer"] != nil {
		t.Errorf("summary %v: want since_last_line, no first, no last_answer (the last drop had no attempt)", got[1])
	}
	time.Sleep(2 * l.every)
	if n := len(lines()); n != 2 {
		t.Errorf("%d lines with no drop since the summary, want 2", n)
	}

	// A drop after a quiet while is logged at once; the one after it
	// waits, and stop logs it.
	drop(4, forward.DropStopped, 1, answer)
	drop(5, forward.DropStopped, 1, answer)
	l.stop()
	got = lines()
	if len(got) != 4 {
		t.Fatalf("%d lines after two more drops and the stop, want 4", len(got))
	}
	check(got[2], map[string]any{"dropped": 1, "stopped": 1, "last_report": "fwd/1/4"})
	check(got[3], map[string]any{"dropped": 1, "stopped": 1, "last_report": "fwd/1/5"})
	time.Sleep(2 * l.every)
	if n := len(lines()); n != 4 {
		t.Errorf("%d lines after the stop, want 4: nothing more", n)
	}
}

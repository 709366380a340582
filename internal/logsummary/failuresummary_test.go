package logsummary

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// A failureSummary WARNs at the first failure, then holds the failures of
// the next minute: 50 failures are one line (the first, count 1); the
// first failure a minute later WARNs the summary of the 49 held and
// itself, count 50, with the time since the last summary.
func TestFailureSummaryAggregates(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	now := time.Date(2026, 12, 4, 6, 0, 0, 0, time.UTC)
	s := NewFailureSummary(zap.New(core), summaryMsg, []string{"no-client-certificate", "other"}, "each at DEBUG")
	s.now = func() time.Time { return now }
	for range 50 {
		s.Add("no-client-certificate")
		now = now.Add(time.Second)
	}
	if got := logs.Len(); got != 1 {
		t.Fatalf("%d lines for 50 failures within a minute, want 1", got)
	}
	first := logs.All()[0]
	if first.Level != zapcore.WarnLevel || first.Message != summaryMsg ||
		first.ContextMap()["first"] != true || first.ContextMap()["no-client-certificate"] != uint64(1) || first.ContextMap()["details"] != "each at DEBUG" {
		t.Errorf("first summary %s %q %v, want a WARN, first, count 1", first.Level, first.Message, first.ContextMap())
	}
	now = time.Date(2026, 12, 4, 6, 1, 0, 0, time.UTC) // a minute after the first
	s.Add("no-client-certificate")
	if got := logs.Len(); got != 2 {
		t.Fatalf("%d lines, want the second summary", got)
	}
	second := logs.All()[1].ContextMap()
	if second["no-client-certificate"] != uint64(50) || second["since_last_summary"] != time.Minute || second["first"] != nil || second["other"] != nil {
		t.Errorf("second summary %v, want no-client-certificate 50 since 1m, no other reason", second)
	}
}

const summaryMsg = "sandbox tunnels rejected without a verified client certificate"

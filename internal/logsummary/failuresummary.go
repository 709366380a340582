package logsummary

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// FailureSummary is how failures that anyone who can reach a port may
// cause are logged: each by its owner at DEBUG, never a WARN or an ERROR
// of its own, and here, at most once per every, one WARN summary (msg)
// that counts the failures since the last summary by reason. The first
// failure is summarized at once (first: true); the failures after a
// summary wait for the first one at least every later, whose summary
// counts them all with since_last_summary. Connection-level failures
// (failed handshakes, tunnels refused for want of a verified client
// certificate) go through one each, so a flood of them is one line a
// minute, whatever the client authentication mode.
type FailureSummary struct {
	logger  *zap.Logger
	msg     string
	reasons []string // the order the summary lists them in
	details string   // where each failure is, and what counts them
	every   time.Duration
	now     func() time.Time

	mu     sync.Mutex
	last   time.Time // of the last summary
	counts map[string]uint64
}

// failureSummaryEvery spaces the WARN summaries of a failureSummary.
const failureSummaryEvery = time.Minute

func NewFailureSummary(logger *zap.Logger, msg string, reasons []string, details string) *FailureSummary {
	return &FailureSummary{logger: logger, msg: msg, reasons: reasons, details: details, every: failureSummaryEvery,
		now: time.Now, counts: map[string]uint64{}}
}

// Add counts one failure of reason and WARNs the summary when it is due.
func (s *FailureSummary) Add(reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.counts[reason]++
	now := s.now()
	if now.Sub(s.last) < s.every {
		return
	}
	fields := []zap.Field{zap.Duration("since_last_summary", now.Sub(s.last))}
	if s.last.IsZero() {
		fields[0] = zap.Bool("first", true)
	}
	for _, r := range s.reasons {
		if n := s.counts[r]; n > 0 {
			fields = append(fields, zap.Uint64(r, n))
		}
	}
	s.logger.Warn(s.msg, append(fields, zap.String("details", s.details))...)
	s.last, s.counts = now, map[string]uint64{}
}

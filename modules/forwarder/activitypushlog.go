package forwarder

import (
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/forward"
)

// pushDropLog logs the activity reports a pusher dropped (forward.Drop):
// billing data the control plane did not get, never silently. The first
// drop is logged at once; the drops after a line wait at most
// pushDropSummaryEvery for the next, which counts them all by reason;
// Stop logs what no line has yet. Every line is a WARN that names the
// receiver, the last report dropped and the control plane's answer to it.
type pushDropLog struct {
	logger *zap.Logger
	url    string
	every  time.Duration
	now    func() time.Time

	mu     sync.Mutex
	last   time.Time // of the last line
	counts map[string]uint64
	latest forward.Drop // the last drop not yet logged
	timer  *time.Timer  // the next line's, while drops wait for it
}

// pushDropSummaryEvery spaces the lines of a pushDropLog.
const pushDropSummaryEvery = time.Minute

// PushDropMsg is the message of every pushDropLog line.
const PushDropMsg = "activity reports dropped: the control plane did not get them"

func newPushDropLog(logger *zap.Logger, url string) *pushDropLog {
	return &pushDropLog{logger: logger, url: url, every: pushDropSummaryEvery, now: time.Now, counts: map[string]uint64{}}
}

// drop records d (forward.PusherConfig.OnDrop).
func (l *pushDropLog) drop(d forward.Drop) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.counts[d.Reason]++
	l.latest = d
	now := l.now()
	if since := now.Sub(l.last); l.last.IsZero() || since >= l.every {
		l.logLocked(now)
	} else if l.timer == nil {
		l.timer = time.AfterFunc(l.every-since, l.flush)
	}
}

// flush logs the drops that wait for a line.
func (l *pushDropLog) flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.timer = nil
	if len(l.counts) > 0 {
		l.logLocked(l.now())
	}
}

// stop logs the drops that wait for a line, at once: the pusher has
// stopped, and no drop comes after.
func (l *pushDropLog) stop() {
	l.mu.Lock()
	if l.timer != nil {
		l.timer.Stop()
	}
	l.mu.Unlock()
	l.flush()
}

func (l *pushDropLog) logLocked(now time.Time) {
	var n uint64
	fields := []zap.Field{zap.String("url", l.url)}
	if l.last.IsZero() {
		fields = append(fields, zap.Bool("first", true))
	} else {
		fields = append(fields, zap.Duration("since_last_line", now.Sub(l.last)))
	}
	for _, r := range forward.DropReasons() {
		if c := l.counts[r]; c > 0 {
			fields = append(fields, zap.Uint64(r, c))
			n += c
		}
	}
	d := l.latest
	fields = append(fields, zap.Uint64("dropped", n), zap.String("last_report", d.Report.ID), zap.String("last_reason", d.Reason),
		zap.Int("last_attempts", d.Attempts))
	if d.Err != nil {
		fields = append(fields, zap.NamedError("last_answer", d.Err))
	}
	l.logger.Warn(PushDropMsg, append(fields, zap.String("details",
		`caddy_ktls_activity_reports_total{outcome="dropped"} counts them; the next report delivered carries each sandbox's totals, the lost bytes included`))...)
	l.last, l.counts = now, map[string]uint64{}
}

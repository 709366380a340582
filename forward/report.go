package forward

import (
	"fmt"
	"time"
)

// ReportID identifies an activity report so that a control plane can
// deduplicate it: the forwarder instance, the start of its registry (the
// process, normally) and the report's sequence number, which a registry
// counts up from 1 for every report taken, whichever Pusher takes it. A
// report delivery is at least once: a retry, a repeated POST after a lost
// answer, resends the same body, ID and sequence included.
type ReportID struct {
	// ID is "<instance>/<process start in Unix nanoseconds>/<sequence>",
	// unique per report: the deduplication key.
	ID string `json:"id"`
	// Instance names the forwarder (PusherConfig.Instance: the host name
	// unless configured).
	Instance string `json:"instance"`
	// ProcessStart is when the registry was made: the process start,
	// normally. Sequences and sandbox totals restart with it.
	ProcessStart time.Time `json:"process_start"`
	// Sequence numbers the reports of a process from 1, in the order the
	// registry took their deltas. A gap is a report that was dropped, or
	// delivered to another URL (each sandbox handler's pusher takes its
	// share of the one registry's deltas).
	Sequence uint64 `json:"sequence"`
	// SentAt is when the report's deltas were taken (a retry keeps it).
	SentAt time.Time `json:"sent_at"`
}

// TakeReport takes the deltas as TakeDeltas does and, when there are any,
// numbers them as the registry's next report from instance. It returns
// false, and numbers nothing, when no sandbox moved a byte or has a tunnel
// open.
func (r *Registry) TakeReport(instance string) (ActivityReport, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ds := r.takeDeltasLocked()
	if len(ds) == 0 {
		return ActivityReport{}, false
	}
	r.seq++
	start := r.started.UTC()
	id := ReportID{
		ID:       fmt.Sprintf("%s/%d/%d", instance, start.UnixNano(), r.seq),
		Instance: instance, ProcessStart: start, Sequence: r.seq, SentAt: time.Now().UTC(),
	}
	r.last = id
	return ActivityReport{ReportID: id, Sandboxes: ds}, true
}

// LastReport returns the identity of the latest report TakeReport took
// (zero before the first).
func (r *Registry) LastReport() ReportID {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last
}

// Started returns when the registry was made (ReportID.ProcessStart).
func (r *Registry) Started() time.Time {
	return r.started
}

package forward

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"time"

	"github.com/ktlsingress/caddy-ktls/internal/wire"
)

// A binary upgrade moves the activity-report stream to the new process
// with the tunnels: the stream (ReportID's instance, process start and
// sequence) continues there, with every sandbox's cumulative totals and
// the deltas not reported yet, so the control plane sees one stream
// without a gap or a byte counted twice. The old process, which keeps only
// the tunnels that could not move, starts a stream of its own for their
// bytes from the handoff on. Close's refusals (refuse_for) move too.

// ReportStateVersion is the ReportState.Version this build writes and
// adopts.
const ReportStateVersion = 1

// ReportState is a registry's report stream and sandbox counters, as
// HandOff exports them and AdoptReports takes them.
type ReportState struct {
	Version int `json:"version"`
	// Started, Sequence and Last continue the stream (ReportID).
	Started  time.Time `json:"started"`
	Sequence uint64    `json:"sequence"`
	Last     ReportID  `json:"last"`
	// NextTunnelID ends the tunnel IDs the old process gives: the new
	// process numbers on from it, so a moved tunnel keeps its ID and no
	// two share one. It is the last ID given at the export plus
	// LateTunnelIDs, which the old process numbers the tunnels it opens
	// afterwards with (the connections it accepted before the switch).
	NextTunnelID uint64         `json:"next_tunnel_id"`
	Sandboxes    []SandboxState `json:"sandboxes"`
	// Refusing are the sandboxes Close refuses new tunnels to, until when.
	Refusing map[string]time.Time `json:"refusing,omitempty"`
	// Buckets are the bandwidth caps' token buckets, with what they held:
	// the old process's are emptied, so the two never grant together more
	// than one would have at the handoff.
	Buckets []BucketState `json:"buckets,omitempty"`
}

// SandboxState is one sandbox's counters in a ReportState.
type SandboxState struct {
	Sandbox      string    `json:"sandbox"`
	Since        time.Time `json:"since"`
	TotalTunnels int64     `json:"total_tunnels"`
	ToSandbox    int64     `json:"to_sandbox"`
	FromSandbox  int64     `json:"from_sandbox"`
	// PendingTo and PendingFrom are the bytes no report has carried yet.
	PendingTo   int64 `json:"pending_to"`
	PendingFrom int64 `json:"pending_from"`
	// ReportedTo, ReportedFrom and ReportedOpen are the stream's totals
	// and the open tunnels its last entry for the sandbox said.
	ReportedTo   int64     `json:"reported_to"`
	ReportedFrom int64     `json:"reported_from"`
	ReportedOpen int64     `json:"reported_open"`
	LastActivity time.Time `json:"last_activity"`
}

// LateTunnelIDs is how many tunnel IDs a handoff leaves to the old
// process (ReportState.NextTunnelID): more than the connections one process
// can hold.
const LateTunnelIDs = 1 << 24

// ErrHandingOff is what a second HandOff returns while one is in progress.
var ErrHandingOff = errors.New("forward: a handoff of the report stream is in progress")

// HandOff exports r's report stream for another process to adopt, and
// stops TakeReport and TakeDeltas (they find nothing) until done is
// called. Tunnels keep counting meanwhile. done(true): the stream moved;
// r starts a new one (Started now, sequence from 1) whose totals are what
// its tunnels count beyond what was exported. done(false): nothing moved,
// reports go on as before, nothing lost. The moved tunnels are closed
// here before done(true).
//
// The bandwidth caps' buckets are emptied into the export (done(false)
// refills them). Their sandboxes' tunnels that stay here (those that could
// not move) then share a bucket that refills from empty, while the moved
// ones use the exported level: until the last of them ends, such a
// sandbox may move up to twice its cap across the two processes.
func (r *Registry) HandOff() (ReportState, func(moved bool), error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.handingOff {
		return ReportState{}, nil, ErrHandingOff
	}
	r.handingOff = true
	now := time.Now()
	st := ReportState{Version: ReportStateVersion, Started: r.started, Sequence: r.seq, Last: r.last, NextTunnelID: r.nextID + LateTunnelIDs}
	exported := make(map[*sandboxCounters]SandboxState, len(r.sandboxes))
	for id, sb := range r.sandboxes {
		s := SandboxState{
			Sandbox: id, Since: sb.since, TotalTunnels: sb.total.Load(),
			ToSandbox: sb.toSandbox.Load(), FromSandbox: sb.fromSandbox.Load(),
			PendingTo: sb.pendingTo.Load(), PendingFrom: sb.pendingFrom.Load(),
			ReportedTo: sb.reportedTo, ReportedFrom: sb.reportedFrom, ReportedOpen: sb.reportedOpen,
			LastActivity: time.Unix(0, sb.lastActivity.Load()),
		}
		exported[sb] = s
		st.Sandboxes = append(st.Sandboxes, s)
	}
	for id, until := range r.refusing {
		if now.Before(until) {
			if st.Refusing == nil {
				st.Refusing = map[string]time.Time{}
			}
			st.Refusing[id] = until
		}
	}
	var putBack func()
	st.Buckets, putBack = r.bandwidth.take()
	done := func(moved bool) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.handingOff = false
		if !moved {
			putBack()
			return
		}
		// What was exported is the new process's to report; what the
		// tunnels counted since is this one's new stream.
		r.started, r.seq, r.last = time.Now(), 0, ReportID{}
		for sb, s := range exported {
			sb.since = r.started
			sb.total.Add(-s.TotalTunnels + sb.open.Load())
			sb.toSandbox.Add(-s.ToSandbox)
			sb.fromSandbox.Add(-s.FromSandbox)
			sb.pendingTo.Add(-s.PendingTo)
			sb.pendingFrom.Add(-s.PendingFrom)
			sb.reportedTo, sb.reportedFrom, sb.reportedOpen = 0, 0, 0
		}
	}
	return st, done, nil
}

// AdoptReports continues the report stream st (another process's
// HandOff) in r, which must be new: no tunnel opened and no report taken,
// so that no ID or sequence number is given twice. Its sandboxes' counters
// and Close's refusals are r's from now on; their open tunnels count from
// zero until the moved ones are adopted. No report is taken (TakeReport,
// TakeDeltas find nothing) until ResumeReports: until the handoff ends,
// the other process may take the stream back (its HandOff's done(false),
// when this one dies), and must find no number of it given.
func (r *Registry) AdoptReports(st ReportState) error {
	if st.Version != ReportStateVersion {
		return fmt.Errorf("forward: report state version %d, this build adopts %d", st.Version, ReportStateVersion)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.opened.Load() != 0 || r.seq != 0 || len(r.sandboxes) != 0 {
		return fmt.Errorf("forward: the registry has opened %d tunnels and taken %d reports: a report stream is adopted before either", r.opened.Load(), r.seq)
	}
	r.started, r.seq, r.last, r.nextID = st.Started, st.Sequence, st.Last, st.NextTunnelID
	for _, s := range st.Sandboxes {
		sb := &sandboxCounters{since: s.Since, reportedTo: s.ReportedTo, reportedFrom: s.ReportedFrom, reportedOpen: s.ReportedOpen}
		sb.total.Store(s.TotalTunnels)
		sb.toSandbox.Store(s.ToSandbox)
		sb.fromSandbox.Store(s.FromSandbox)
		sb.pendingTo.Store(s.PendingTo)
		sb.pendingFrom.Store(s.PendingFrom)
		sb.lastActivity.Store(s.LastActivity.UnixNano())
		r.sandboxes[s.Sandbox] = sb
	}
	for id, until := range st.Refusing {
		r.refusing[id] = until
	}
	r.bandwidth.seed(st.Buckets)
	r.handingOff = true
	return nil
}

// ResumeReports ends the hold of AdoptReports once the handoff has ended:
// the stream is r's alone.
func (r *Registry) ResumeReports() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.handingOff = false
}

// TunnelState is a tunnel's registration as it moves to another process:
// its identity, who opened it and what it counted.
type TunnelState struct {
	ID          uint64
	Sandbox     string
	Target      string
	Peer        string
	Certificate string
	// CertificateNames are the client certificate's names (Close matches
	// them); KeyID and Key the key that signed the preamble (Revoke).
	CertificateNames []string
	KeyID            string
	Key              []byte
	Opened           time.Time
	LastActivity     time.Time
	ToSandbox        int64
	FromSandbox      int64
}

// write appends s's fields in the order readTunnelState reads them.
func (s *TunnelState) write(w *wire.Writer) {
	w.Uint(s.ID)
	for _, v := range []string{s.Sandbox, s.Target, s.Peer, s.Certificate} {
		w.Text(v)
	}
	w.Texts(s.CertificateNames)
	w.Text(s.KeyID)
	w.Bytes(s.Key)
	w.Time(s.Opened)
	w.Time(s.LastActivity)
	w.Int(s.ToSandbox)
	w.Int(s.FromSandbox)
}

func readTunnelState(r *wire.Reader) TunnelState {
	var s TunnelState
	r.Field("tunnel")
	s.ID = r.Uint()
	for _, v := range []*string{&s.Sandbox, &s.Target, &s.Peer, &s.Certificate} {
		*v = r.Text()
	}
	s.CertificateNames = r.Texts()
	s.KeyID = r.Text()
	s.Key = r.Bytes()
	s.Opened = r.Time()
	s.LastActivity = r.Time()
	s.ToSandbox = r.Int()
	s.FromSandbox = r.Int()
	return s
}

// State returns t's registration for another process to adopt.
func (t *Tunnel) State() TunnelState {
	return TunnelState{
		ID: t.ID, Sandbox: t.Sandbox, Target: t.Target, Peer: t.Peer, Certificate: t.Certificate,
		CertificateNames: t.names, KeyID: t.KeyID, Key: t.key, Opened: t.Opened,
		LastActivity: time.Unix(0, t.lastActive.Load()), ToSandbox: t.toSandbox.Load(), FromSandbox: t.fromSandbox.Load(),
	}
}

// AdoptTunnel registers a tunnel another process moved here, after
// AdoptReports took its stream: its ID, origin and counts go on, and its
// sandbox's totals, which hold its opening and its bytes already, count
// it open. The tunnel's relay must run under the returned context, as
// Open's.
func (r *Registry) AdoptTunnel(s TunnelState) (*Tunnel, context.Context, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.draining {
		return nil, nil, &RefusalError{Reason: ReasonDraining, Err: drainingError{}}
	}
	if s.ID == 0 || s.ID > r.nextID {
		return nil, nil, fmt.Errorf("forward: moved tunnel %d: IDs given so far end at %d (its report stream was not adopted)", s.ID, r.nextID)
	}
	if _, dup := r.tunnels[s.ID]; dup {
		return nil, nil, fmt.Errorf("forward: moved tunnel %d is registered already", s.ID)
	}
	sb := r.sandboxes[s.Sandbox]
	if sb == nil {
		return nil, nil, fmt.Errorf("forward: moved tunnel %d: sandbox %s is not in the adopted report stream", s.ID, s.Sandbox)
	}
	sb.open.Add(1)
	ctx, cancel := context.WithCancelCause(context.Background())
	t := &Tunnel{ID: s.ID, Sandbox: s.Sandbox, Target: s.Target, Opened: s.Opened, reg: r, sb: sb, cancel: cancel,
		Origin: Origin{Peer: s.Peer, Certificate: s.Certificate, KeyID: s.KeyID, key: ed25519.PublicKey(s.Key), names: s.CertificateNames}}
	t.lastActive.Store(s.LastActivity.UnixNano())
	t.toSandbox.Store(s.ToSandbox)
	t.fromSandbox.Store(s.FromSandbox)
	r.tunnels[t.ID] = t
	return t, ctx, nil
}

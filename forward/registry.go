package forward

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"maps"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ktlsingress/caddy-ktls/splice"
)

// Registry is the process-level state of all tunnels: the open ones with
// their live byte counters, per-sandbox totals, and the rejections by reason.
// A process normally has exactly one, shared by every configuration that is
// loaded over the process's lifetime, so that tunnels and counters survive
// reloads. All methods are safe for concurrent use; the data path touches
// only atomics.
type Registry struct {
	mu        sync.Mutex
	nextID    uint64
	tunnels   map[uint64]*Tunnel
	sandboxes map[string]*sandboxCounters
	rejects   map[string]uint64
	draining  bool
	idle      chan struct{} // closed and replaced whenever the last open tunnel closes
	lastPrune time.Time
	// started identifies this registry's counters (the process, normally)
	// in activity reports; seq numbers the reports taken (TakeReport), and
	// last is the latest one's identity.
	started time.Time
	seq     uint64
	last    ReportID
	// refusing holds the sandboxes that Close refuses new tunnels to, until
	// when.
	refusing map[string]time.Time
	// handingOff is set while the report stream moves, HandOff's until
	// its verdict, AdoptReports' until ResumeReports: no report is taken
	// meanwhile.
	handingOff bool

	opened  atomic.Uint64
	dialing atomic.Int64 // tunnels dialing their target now (startDial)
	opening atomic.Int64 // Serve calls that have neither opened a tunnel nor been refused
	// standby counts, by client, the standby connections waiting now, and
	// standbyWaits holds them (MoveStandby); standbyEnds counts how they
	// ended (StandbyEnds).
	standby      map[string]int
	standbyWaits map[*standbyWait]struct{}
	standbyEnds  map[string]uint64
	expired      atomic.Uint64 // tunnels ended at Config.MaxTunnelLifetime
	revoked      atomic.Uint64 // tunnels ended by Revoke
	closed       atomic.Uint64 // tunnels ended as failures by Close
	// Bytes of all tunnels ever, by direction (sandbox entries are pruned).
	toSandbox, fromSandbox atomic.Int64
	// Data-path totals of closed tunnels' relays (package splice's counters).
	spliceBytes, copyBytes, controlRecords, pipeShortages atomic.Int64
	// The buckets of bandwidth-capped sandboxes (bandwidth.go).
	bandwidth limiterTable

	// Retention is how long a sandbox with no open tunnel keeps its entry
	// (totals and unreported deltas) after its last activity. Zero means one
	// hour. It bounds memory in a long-lived process that sees many sandboxes.
	Retention time.Duration
}

type sandboxCounters struct {
	open, total            atomic.Int64
	toSandbox, fromSandbox atomic.Int64
	pendingTo, pendingFrom atomic.Int64 // not yet taken by TakeDeltas
	lastActivity           atomic.Int64 // unix nanoseconds
	// since is when the registry made this entry: the start of its totals.
	since time.Time
	// reportedTo and reportedFrom sum the deltas TakeReport and TakeDeltas
	// took (under Registry.mu): the cumulative totals of the reports.
	reportedTo, reportedFrom int64
	// reportedOpen is the open tunnels of the last delta taken (under
	// Registry.mu), so that a sandbox whose last tunnel closed after its
	// bytes were taken still gets the entry that says so.
	reportedOpen int64
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{
		tunnels:      make(map[uint64]*Tunnel),
		sandboxes:    make(map[string]*sandboxCounters),
		rejects:      make(map[string]uint64),
		idle:         make(chan struct{}),
		started:      time.Now(),
		refusing:     make(map[string]time.Time),
		standby:      make(map[string]int),
		standbyWaits: make(map[*standbyWait]struct{}),
		standbyEnds:  make(map[string]uint64),
	}
}

// Tunnel is one open tunnel. Its counters are updated by the relay as bytes
// move and are readable at any time.
type Tunnel struct {
	ID      uint64
	Sandbox string
	Target  string
	Origin
	Opened time.Time

	reg         *Registry
	sb          *sandboxCounters
	toSandbox   atomic.Int64
	fromSandbox atomic.Int64
	lastActive  atomic.Int64

	// cancel stops the tunnel's relay with a cause (nil: context.Canceled);
	// a forced drain, Revoke and Close call it.
	cancel context.CancelCauseFunc
	// closing is set by the Close that ends the tunnel, so that another
	// one neither counts nor reports it again.
	closing atomic.Bool
	// movable is set while the tunnel's relay runs (MoveTunnels).
	movable atomic.Pointer[movable]
}

// TunnelInfo is a snapshot of one tunnel, as served by the admin API.
type TunnelInfo struct {
	ID      uint64 `json:"id"`
	Sandbox string `json:"sandbox"`
	Target  string `json:"target"`
	Origin
	Opened           time.Time `json:"opened"`
	LastActivity     time.Time `json:"last_activity"`
	BytesToSandbox   int64     `json:"bytes_to_sandbox"`
	BytesFromSandbox int64     `json:"bytes_from_sandbox"`
}

// SandboxActivity is a snapshot of one sandbox's counters: totals since the
// registry first saw it, as served by the admin API.
type SandboxActivity struct {
	Sandbox          string    `json:"sandbox"`
	OpenTunnels      int64     `json:"open_tunnels"`
	TotalTunnels     int64     `json:"total_tunnels"`
	BytesToSandbox   int64     `json:"bytes_to_sandbox"`
	BytesFromSandbox int64     `json:"bytes_from_sandbox"`
	LastActivity     time.Time `json:"last_activity"`
	// Since is when the registry made the sandbox's entry: the start of
	// its totals (an entry idle for Retention is forgotten, and a later
	// tunnel starts a new one).
	Since time.Time `json:"since"`
	// ReportedBytesToSandbox and ReportedBytesFromSandbox are the
	// cumulative totals of the activity reports taken so far (the
	// total_bytes_* of the latest report that carried this sandbox): the
	// live counters above less what the next report will carry.
	ReportedBytesToSandbox   int64 `json:"reported_bytes_to_sandbox"`
	ReportedBytesFromSandbox int64 `json:"reported_bytes_from_sandbox"`
}

// SandboxDelta is what a sandbox moved since the previous TakeDeltas (or
// TakeReport), and the cumulative totals of all of them.
type SandboxDelta struct {
	Sandbox          string    `json:"sandbox"`
	BytesToSandbox   int64     `json:"bytes_to_sandbox"`
	BytesFromSandbox int64     `json:"bytes_from_sandbox"`
	OpenTunnels      int64     `json:"open_tunnels"`
	LastActivity     time.Time `json:"last_activity"`
	// TotalBytesToSandbox and TotalBytesFromSandbox are the sum of this
	// sandbox's deltas in every report taken since Since, this one's
	// included: a receiver that lost a report recovers its bytes as the
	// difference of two totals, and one that sees a report twice
	// (at-least-once delivery) sees the same totals again.
	TotalBytesToSandbox   int64 `json:"total_bytes_to_sandbox"`
	TotalBytesFromSandbox int64 `json:"total_bytes_from_sandbox"`
	// Since is when the registry made the sandbox's entry, where its totals
	// start. An entry with no open tunnel is forgotten after
	// Registry.Retention idle; a later tunnel starts a new entry, totals
	// from zero, with a new Since.
	Since time.Time `json:"since"`
}

// drainingError is the cause in the RefusalError (ReasonDraining) that Open
// and Forwarder.Serve return while the registry drains.
type drainingError struct{}

func (drainingError) Error() string { return "the forwarder is draining before exit" }

// Origin is who opened a tunnel, as its logs, events and the admin API
// attribute it.
type Origin struct {
	// Peer is the client's remote address.
	Peer string `json:"peer"`
	// Certificate is the subject of the client's TLS certificate (for
	// example "CN=gateway-1"); empty when it presented none.
	Certificate string `json:"client_certificate,omitempty"`
	// KeyID names the key that signed the accepted preamble.
	KeyID string `json:"key_id"`
	// key is that key, so that a key ID given to another key is a
	// revocation too (Revoke).
	key ed25519.PublicKey
	// names are the client certificate's names (Client.CertificateNames),
	// which Close matches as well as the subject.
	names []string
}

// Open registers a new tunnel, or refuses it while the registry drains or
// when sandbox already has maxTunnelsPerSandbox tunnels open (zero: no cap). The
// tunnel's relay must run under the returned context: Drain cancels it when
// the grace period is over.
func (r *Registry) Open(sandbox, target string, origin Origin, maxTunnelsPerSandbox int) (*Tunnel, context.Context, error) {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.draining {
		return nil, nil, &RefusalError{Reason: ReasonDraining, Err: drainingError{}}
	}
	if err := r.checkRefusedLocked(sandbox, now); err != nil {
		return nil, nil, err
	}
	if err := r.checkLimitLocked(sandbox, maxTunnelsPerSandbox); err != nil {
		return nil, nil, err
	}
	r.pruneLocked(now)
	r.nextID++
	sb := r.sandboxes[sandbox]
	if sb == nil {
		sb = &sandboxCounters{since: now}
		r.sandboxes[sandbox] = sb
	}
	sb.open.Add(1)
	sb.total.Add(1)
	sb.lastActivity.Store(now.UnixNano())
	ctx, cancel := context.WithCancelCause(context.Background())
	t := &Tunnel{ID: r.nextID, Sandbox: sandbox, Target: target, Origin: origin, Opened: now, reg: r, sb: sb, cancel: cancel}
	t.lastActive.Store(now.UnixNano())
	r.tunnels[t.ID] = t
	r.opened.Add(1)
	return t, ctx, nil
}

// checkAdmit refuses a tunnel to sandbox that Close refuses, or that has
// maxTunnelsPerSandbox tunnels open already (zero: no cap).
func (r *Registry) checkAdmit(sandbox string, maxTunnelsPerSandbox int) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.checkRefusedLocked(sandbox, time.Now()); err != nil {
		return err
	}
	return r.checkLimitLocked(sandbox, maxTunnelsPerSandbox)
}

// checkLimitLocked refuses a tunnel to sandbox when it has
// maxTunnelsPerSandbox tunnels open already (zero: no cap).
func (r *Registry) checkLimitLocked(sandbox string, maxTunnelsPerSandbox int) error {
	if sb := r.sandboxes[sandbox]; maxTunnelsPerSandbox > 0 && sb != nil && sb.open.Load() >= int64(maxTunnelsPerSandbox) {
		return &RefusalError{Reason: ReasonTunnelLimit, Err: fmt.Errorf("sandbox %s has %d tunnels open, the most allowed", sandbox, maxTunnelsPerSandbox)}
	}
	return nil
}

func (r *Registry) pruneLocked(now time.Time) {
	if now.Sub(r.lastPrune) < time.Minute {
		return
	}
	r.lastPrune = now
	keep := r.Retention
	if keep == 0 {
		keep = time.Hour
	}
	for id, sb := range r.sandboxes {
		if sb.open.Load() == 0 && now.Sub(time.Unix(0, sb.lastActivity.Load())) > keep {
			delete(r.sandboxes, id)
		}
	}
	for id, until := range r.refusing {
		if !now.Before(until) {
			delete(r.refusing, id)
		}
	}
}

// startDial admits one more dial to a target unless maxDials are in
// progress (zero: no bound); done ends it.
func (r *Registry) startDial(maxDials int) (done func(), err error) {
	if n := r.dialing.Add(1); maxDials > 0 && n > int64(maxDials) {
		r.dialing.Add(-1)
		return nil, &RefusalError{Reason: ReasonOverloaded, Err: fmt.Errorf("%d tunnels are dialing their targets, the most allowed at once", maxDials)}
	}
	return func() { r.dialing.Add(-1) }, nil
}

// enterStandby admits w, one more standby connection of client, unless
// max are waiting; leave ends it, counting how when it ended without a
// preamble (end not "").
func (r *Registry) enterStandby(client string, max int, w *standbyWait) (leave func(end string), ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.standby[client] >= max {
		return nil, false
	}
	r.standby[client]++
	r.standbyWaits[w] = struct{}{}
	return func(end string) {
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.standby[client]--; r.standby[client] == 0 {
			delete(r.standby, client)
		}
		delete(r.standbyWaits, w)
		if end != "" {
			r.standbyEnds[end]++
		}
	}, true
}

// Standby returns how many standby connections wait for their first
// preamble byte now, and how many ended, by end (StandbyEnds).
func (r *Registry) Standby() (waiting int, ends map[string]uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, n := range r.standby {
		waiting += n
	}
	return waiting, maps.Clone(r.standbyEnds)
}

// Opening returns how many Serve calls have neither opened their tunnel
// nor been refused yet: standby connections waiting for their first
// preamble byte (Standby), and connections reading, checking or dialing.
func (r *Registry) Opening() int64 { return r.opening.Load() }

// Dialing returns how many tunnels are dialing their target now, wakes
// included.
func (r *Registry) Dialing() int64 { return r.dialing.Load() }

// Reject counts a refused tunnel under its reason.
func (r *Registry) Reject(reason string) {
	r.mu.Lock()
	r.rejects[reason]++
	r.mu.Unlock()
}

// Rejections returns the refused tunnels counted so far, by reason.
func (r *Registry) RefusedTunnels() map[string]uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	m := make(map[string]uint64, len(r.rejects))
	for k, v := range r.rejects {
		m[k] = v
	}
	return m
}

// AddToSandbox counts n bytes moved from the client towards the sandbox.
func (t *Tunnel) AddToSandbox(n int64) {
	t.toSandbox.Add(n)
	t.reg.toSandbox.Add(n)
	t.sb.toSandbox.Add(n)
	t.sb.pendingTo.Add(n)
	t.touch()
}

// AddFromSandbox counts n bytes moved from the sandbox towards the client.
func (t *Tunnel) AddFromSandbox(n int64) {
	t.fromSandbox.Add(n)
	t.reg.fromSandbox.Add(n)
	t.sb.fromSandbox.Add(n)
	t.sb.pendingFrom.Add(n)
	t.touch()
}

func (t *Tunnel) touch() {
	now := time.Now().UnixNano()
	t.lastActive.Store(now)
	t.sb.lastActivity.Store(now)
}

// Info returns a snapshot of the tunnel.
func (t *Tunnel) Info() TunnelInfo {
	return TunnelInfo{
		ID: t.ID, Sandbox: t.Sandbox, Target: t.Target, Origin: t.Origin, Opened: t.Opened,
		LastActivity:     time.Unix(0, t.lastActive.Load()),
		BytesToSandbox:   t.toSandbox.Load(),
		BytesFromSandbox: t.fromSandbox.Load(),
	}
}

// Close deregisters the tunnel. It is idempotent.
func (t *Tunnel) Close() {
	r := t.reg
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.tunnels[t.ID]; !ok {
		return
	}
	delete(r.tunnels, t.ID)
	t.cancel(nil)
	t.sb.open.Add(-1)
	if len(r.tunnels) == 0 {
		close(r.idle)
		r.idle = make(chan struct{})
	}
}

// Totals returns the bytes all tunnels have moved since the registry was
// made, towards and from the sandboxes.
func (r *Registry) Totals() (toSandbox, fromSandbox int64) {
	return r.toSandbox.Load(), r.fromSandbox.Load()
}

// Revoke ends, as failures, the open tunnels whose preamble was signed by
// a key that trusted no longer accepts (trusted gets the key's ID and the
// key itself): what a reload does when the new configuration stopped
// trusting a gateway key. It returns how many tunnels it ended; their
// Serve returns a *RevokedError.
func (r *Registry) Revoke(trusted func(keyID string, key ed25519.PublicKey) bool) int {
	r.mu.Lock()
	var revoked []*Tunnel
	for _, t := range r.tunnels {
		if !trusted(t.KeyID, t.key) {
			revoked = append(revoked, t)
		}
	}
	r.mu.Unlock()
	for _, t := range revoked {
		t.cancel(&RevokedError{KeyID: t.KeyID})
	}
	r.revoked.Add(uint64(len(revoked)))
	return len(revoked)
}

// RevokedError ends a tunnel whose signing key was revoked (Revoke).
type RevokedError struct {
	KeyID string
}

func (e *RevokedError) Error() string {
	return fmt.Sprintf("the key %s that signed the tunnel's preamble is no longer trusted", e.KeyID)
}

// Revoked returns how many tunnels Revoke has ended since the registry was
// made.
func (r *Registry) Revoked() uint64 {
	return r.revoked.Load()
}

// Expired returns how many tunnels were ended for reaching their lifetime
// (Config.MaxTunnelLifetime) since the registry was made.
func (r *Registry) Expired() uint64 {
	return r.expired.Load()
}

// DataPath is how the bytes of closed tunnels moved.
type DataPath struct {
	SpliceBytes    int64 // moved by splice(2), never entering userspace
	CopyBytes      int64 // copied through userspace (fallback, control-record data)
	ControlRecords int64 // kTLS control records handled in userspace during relays
	PipeShortages  int64 // bursts copied through userspace because no pipe could be opened (out of fds)
}

// DataPath returns the splice/copy totals of the tunnels closed so far.
func (r *Registry) DataPath() DataPath {
	return DataPath{SpliceBytes: r.spliceBytes.Load(), CopyBytes: r.copyBytes.Load(),
		ControlRecords: r.controlRecords.Load(), PipeShortages: r.pipeShortages.Load()}
}

// addRelay adds what a relay did in this process: its counters res less
// base, those it came with from another process.
func (r *Registry) addRelay(res, base splice.Stats) {
	for i, d := range []splice.DirectionStats{res.AToB, res.BToA} {
		b := []splice.DirectionStats{base.AToB, base.BToA}[i]
		r.spliceBytes.Add(d.SpliceBytes - b.SpliceBytes)
		r.copyBytes.Add(d.CopyBytes - b.CopyBytes)
		r.controlRecords.Add(d.ControlRecords - b.ControlRecords)
		r.pipeShortages.Add(d.PipeShortages - b.PipeShortages)
	}
	r.bandwidth.throttledTo.Add(int64(res.AToB.Throttled - base.AToB.Throttled))
	r.bandwidth.throttledFrom.Add(int64(res.BToA.Throttled - base.BToA.Throttled))
}

// Tunnels returns a snapshot of the open tunnels, oldest first.
func (r *Registry) Tunnels() []TunnelInfo {
	list := r.openTunnels()
	infos := make([]TunnelInfo, len(list))
	for i, t := range list {
		infos[i] = t.Info()
	}
	sort.Slice(infos, func(i, j int) bool { return infos[i].ID < infos[j].ID })
	return infos
}

// Counts returns the number of open tunnels and of tunnels opened since the
// registry was made.
func (r *Registry) Counts() (open int, opened uint64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.tunnels), r.opened.Load()
}

// Activity returns a snapshot of every sandbox the registry remembers,
// ordered by sandbox ID.
func (r *Registry) Activity() []SandboxActivity {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]SandboxActivity, 0, len(r.sandboxes))
	for id, sb := range r.sandboxes {
		out = append(out, SandboxActivity{
			Sandbox: id, OpenTunnels: sb.open.Load(), TotalTunnels: sb.total.Load(),
			BytesToSandbox: sb.toSandbox.Load(), BytesFromSandbox: sb.fromSandbox.Load(),
			LastActivity: time.Unix(0, sb.lastActivity.Load()), Since: sb.since,
			ReportedBytesToSandbox: sb.reportedTo, ReportedBytesFromSandbox: sb.reportedFrom,
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Sandbox < out[j].Sandbox })
	return out
}

// TakeDeltas returns, for every sandbox that moved bytes, has an open tunnel
// or had one open at its previous entry, the bytes moved since the previous
// call, and resets them: a sandbox's last entry says open_tunnels 0. Each byte
// is returned by exactly one call, however many callers there are, so the
// deltas of all calls sum to the bytes moved (which is what lets a new
// configuration's pusher take over from the old one's during a reload).
func (r *Registry) TakeDeltas() []SandboxDelta {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.takeDeltasLocked()
}

func (r *Registry) takeDeltasLocked() []SandboxDelta {
	if r.handingOff {
		return nil
	}
	var out []SandboxDelta
	for id, sb := range r.sandboxes {
		to, from := sb.pendingTo.Swap(0), sb.pendingFrom.Swap(0)
		open := sb.open.Load()
		if to == 0 && from == 0 && open == 0 && sb.reportedOpen == 0 {
			continue
		}
		sb.reportedTo += to
		sb.reportedFrom += from
		sb.reportedOpen = open
		out = append(out, SandboxDelta{
			Sandbox: id, BytesToSandbox: to, BytesFromSandbox: from, OpenTunnels: open,
			LastActivity:        time.Unix(0, sb.lastActivity.Load()),
			TotalBytesToSandbox: sb.reportedTo, TotalBytesFromSandbox: sb.reportedFrom, Since: sb.since,
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Sandbox < out[j].Sandbox })
	return out
}

// Draining reports whether Drain has started.
func (r *Registry) Draining() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.draining
}

// Drain refuses new tunnels from now on, waits for the open ones to end
// until ctx is done, then closes the remaining tunnels' connections and
// waits for their relays to finish. It returns how many tunnels it had to
// close. It is meant for process exit only: a reload must never drain.
func (r *Registry) Drain(ctx context.Context) (forced int) {
	r.mu.Lock()
	r.draining = true
	r.mu.Unlock()
	for {
		r.mu.Lock()
		n, idle := len(r.tunnels), r.idle
		r.mu.Unlock()
		if n == 0 {
			return forced
		}
		select {
		case <-idle:
			continue
		case <-ctx.Done():
		}
		r.mu.Lock()
		list := make([]*Tunnel, 0, len(r.tunnels))
		for _, t := range r.tunnels {
			list = append(list, t)
		}
		idle = r.idle
		r.mu.Unlock()
		forced = len(list)
		for _, t := range list {
			t.cancel(nil)
		}
		if len(list) > 0 {
			<-idle
		}
		return forced
	}
}

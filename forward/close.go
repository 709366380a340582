package forward

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/ktlsingress/caddy-ktls/preamble"
)

// MaxRefusals bounds the sandboxes that Close refuses new tunnels to at
// once (CloseRequest.RefuseFor). A Close that would refuse one more is
// itself refused, before it ends anything, with a *RefusalsFullError; a
// refusal frees its place when its period ends, and a Close that only
// lengthens the refusal of a sandbox already refused always passes.
const MaxRefusals = 4096

// RefusalsFullError is a Close refused because MaxRefusals sandboxes are
// refused already.
type RefusalsFullError struct {
	Sandbox string
	Max     int
}

func (e *RefusalsFullError) Error() string {
	return fmt.Sprintf("sandbox %s cannot be refused: %d sandboxes are refused already, the most at once; "+
		"a place frees when a refusal's period ends", e.Sandbox, e.Max)
}

// CloseRequest selects the open tunnels Registry.Close ends: those of one
// sandbox, or those one client certificate opened (exactly one of the two).
type CloseRequest struct {
	// Sandbox selects the tunnels to this sandbox ID. It is
	// case-insensitive, as sandbox IDs are: Close takes its lowercase form
	// (preamble.CanonicalSandboxID), the one tunnels carry.
	Sandbox string
	// Certificate selects the tunnels whose client certificate has this
	// subject (as Origin.Certificate shows it, e.g. "CN=gateway-1") or this
	// name (its Common Name or a DNS name, as Config.KeyClients matches).
	Certificate string
	// Grace, when positive, lets the selected tunnels run that long; those
	// still open then are ended as failures. Zero ends them at once.
	Grace time.Duration
	// RefuseFor, when positive, refuses new tunnels to Sandbox for that
	// long (ReasonSandboxClosed), across configuration reloads. Only with
	// Sandbox.
	// At most MaxRefusals sandboxes are refused at once.
	RefuseFor time.Duration
	// OnGraceEnd, when set, is called once Grace has passed with the
	// tunnels it then ended (none when all had ended by themselves), on a
	// timer's goroutine.
	OnGraceEnd func(ended []TunnelInfo)
}

// CloseResult is what Close selected.
type CloseResult struct {
	// Tunnels are the tunnels selected: ended as failures (Grace zero), or
	// given until Deadline to end by themselves.
	Tunnels []TunnelInfo
	// Deadline is when the tunnels still open are ended (Grace positive).
	Deadline time.Time
	// RefusingUntil is when new tunnels to the sandbox are admitted again
	// (zero: not refused).
	RefusingUntil time.Time
}

// ClosedError ends a tunnel that Registry.Close ended.
type ClosedError struct {
	Sandbox, Certificate string
	Grace                time.Duration
}

func (e *ClosedError) Error() string {
	what := "sandbox " + e.Sandbox
	if e.Certificate != "" {
		what = "client certificate " + e.Certificate
	}
	if e.Grace > 0 {
		return fmt.Sprintf("the tunnel was closed on demand (%s) and was still open after its grace period of %v", what, e.Grace)
	}
	return fmt.Sprintf("the tunnel was closed on demand (%s)", what)
}

// Close ends the open tunnels req selects as failures (their Serve returns
// a *ClosedError, and both sides see a failure end: splice.Abort), at once
// or once req.Grace has passed, and with req.RefuseFor refuses new tunnels
// to req.Sandbox until then. The refusal lives in the registry, so it
// outlives configuration reloads; a later Close can only lengthen it. A
// refusal beyond MaxRefusals fails the Close (*RefusalsFullError) with
// nothing ended. The tunnels it ends are counted (Closed).
func (r *Registry) Close(req CloseRequest) (CloseResult, error) {
	if (req.Sandbox == "") == (req.Certificate == "") {
		return CloseResult{}, errors.New("name exactly one of a sandbox and a client certificate")
	}
	if req.Sandbox != "" {
		id, err := preamble.CanonicalSandboxID(req.Sandbox)
		if err != nil {
			return CloseResult{}, err
		}
		req.Sandbox = id
	}
	if req.Grace < 0 || req.RefuseFor < 0 {
		return CloseResult{}, errors.New("negative grace or refusal period")
	}
	if req.RefuseFor > 0 && req.Sandbox == "" {
		return CloseResult{}, errors.New("a refusal period applies to a sandbox, not to a client certificate")
	}
	now := time.Now()
	var res CloseResult
	r.mu.Lock()
	if req.RefuseFor > 0 {
		if _, ok := r.refusing[req.Sandbox]; !ok && len(r.refusing) >= MaxRefusals {
			for id, until := range r.refusing {
				if !now.Before(until) {
					delete(r.refusing, id)
				}
			}
			if len(r.refusing) >= MaxRefusals {
				r.mu.Unlock()
				return CloseResult{}, &RefusalsFullError{Sandbox: req.Sandbox, Max: MaxRefusals}
			}
		}
		until := now.Add(req.RefuseFor)
		if prev, ok := r.refusing[req.Sandbox]; !ok || until.After(prev) {
			r.refusing[req.Sandbox] = until
		}
		res.RefusingUntil = r.refusing[req.Sandbox]
	}
	var selected []*Tunnel
	for _, t := range r.tunnels {
		if req.selects(t) {
			selected = append(selected, t)
		}
	}
	r.mu.Unlock()
	sort.Slice(selected, func(i, j int) bool { return selected[i].ID < selected[j].ID })
	for _, t := range selected {
		res.Tunnels = append(res.Tunnels, t.Info())
	}
	cause := &ClosedError{Sandbox: req.Sandbox, Certificate: req.Certificate, Grace: req.Grace}
	if req.Grace == 0 {
		r.end(selected, cause)
		return res, nil
	}
	res.Deadline = now.Add(req.Grace)
	time.AfterFunc(req.Grace, func() {
		var ended []TunnelInfo
		r.mu.Lock()
		var open []*Tunnel
		for _, t := range selected {
			if r.tunnels[t.ID] == t {
				open = append(open, t)
			}
		}
		r.mu.Unlock()
		for _, t := range r.end(open, cause) {
			ended = append(ended, t.Info())
		}
		if req.OnGraceEnd != nil {
			req.OnGraceEnd(ended)
		}
	})
	return res, nil
}

func (req CloseRequest) selects(t *Tunnel) bool {
	if req.Sandbox != "" {
		return t.Sandbox == req.Sandbox
	}
	return t.Certificate == req.Certificate || slices.Contains(t.names, req.Certificate)
}

// end ends the tunnels of list that no close has ended yet with cause,
// counts them and returns them.
func (r *Registry) end(list []*Tunnel, cause error) []*Tunnel {
	var ended []*Tunnel
	for _, t := range list {
		if t.closing.CompareAndSwap(false, true) {
			t.cancel(cause)
			ended = append(ended, t)
		}
	}
	r.closed.Add(uint64(len(ended)))
	return ended
}

// Closed returns how many tunnels Close has ended since the registry was
// made.
func (r *Registry) Closed() uint64 {
	return r.closed.Load()
}

// Refusal is a sandbox that Close refuses new tunnels to.
type Refusal struct {
	Sandbox string    `json:"sandbox"`
	Until   time.Time `json:"until"`
}

// Refusals returns the sandboxes refused now, ordered by sandbox ID.
func (r *Registry) Refusals() []Refusal {
	now := time.Now()
	r.mu.Lock()
	defer r.mu.Unlock()
	out := []Refusal{}
	for id, until := range r.refusing {
		if now.Before(until) {
			out = append(out, Refusal{Sandbox: id, Until: until})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Sandbox < out[j].Sandbox })
	return out
}

func (r *Registry) checkRefusedLocked(sandbox string, now time.Time) error {
	until, ok := r.refusing[sandbox]
	if !ok {
		return nil
	}
	if !now.Before(until) {
		delete(r.refusing, sandbox)
		return nil
	}
	return &RefusalError{Reason: ReasonSandboxClosed, Err: fmt.Errorf("sandbox %s was closed: new tunnels to it are refused until %s",
		sandbox, until.UTC().Format(time.RFC3339Nano))}
}

package upgrade

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"slices"
	"sync"

	"github.com/ktlsingress/caddy-ktls/internal/handoff"
)

// The sandbox_handoff app (modules/forwarder) moves the process state, the
// forwarder's standby connections and tunnels itself; a feature that moves
// other objects in the same session registers a Participant at init: the
// old process's app offers the participants' objects once its own have
// moved, and the new one's hands each object of a participant's Kind to
// its Adopt.

// Participant is a feature's part in an upgrade.
type Participant struct {
	// Name names the feature in the handoff's logs and answer (e.g.
	// "gateway": the fields gateway_moved, gateway_stayed, gateway_tunnels).
	Name string
	// Kind is the handoff object kind it moves and adopts (internal/handoff).
	Kind uint16
	// Move offers every object of this process's feature to m, in the old
	// process, and returns what became of them, one that stays named for
	// the logs (a tunnel's route, say).
	Move func(ctx context.Context, m handoff.Mover) handoff.MoveResult[string]
	// Adopt builds, in the new process, the object of state and files
	// (the caller's, as handoff.Item's): run starts it once the old
	// process released it, discard drops it when the old process kept it.
	// An error refuses it: it stays in the old process.
	Adopt func(state []byte, files []*os.File) (run, discard func(), err error)
}

var participants struct {
	mu   sync.Mutex
	list []Participant
}

// Register adds p; a second participant of p's Kind or Name panics.
func Register(p Participant) {
	participants.mu.Lock()
	defer participants.mu.Unlock()
	if slices.ContainsFunc(participants.list, func(q Participant) bool { return q.Kind == p.Kind || q.Name == p.Name }) {
		panic("upgrade: a participant of kind or name already registered: " + p.Name)
	}
	participants.list = append(participants.list, p)
}

// Participants returns the registered participants, in order of
// registration.
func Participants() []Participant {
	participants.mu.Lock()
	defer participants.mu.Unlock()
	return slices.Clone(participants.list)
}

// ForKind returns the participant that adopts kind, false for none.
func ForKind(kind uint16) (Participant, bool) {
	participants.mu.Lock()
	defer participants.mu.Unlock()
	i := slices.IndexFunc(participants.list, func(p Participant) bool { return p.Kind == kind })
	if i < 0 {
		return Participant{}, false
	}
	return participants.list[i], true
}

// MoveName names a handler for an upgrade: the SHA-256 of its JSON
// configuration as loaded (call it before Provision sets anything). An
// object that names no key to choose a handler by (a gateway's standby
// connection at a forwarder, a gateway's tunnel) moves to the new
// process's handler configured the same. Handlers configured alike serve
// alike, so one name for several is no ambiguity.
func MoveName(handler any) (string, error) {
	b, err := json.Marshal(handler)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:]), nil
}

package upgrade

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/handoff"
)

// The sandbox_handoff app (modules/handoff) moves what the features
// register here: first the process state (State: the forwarder's report
// stream and replay caches), then the objects of every Participant in
// Order (the forwarder's standby connections and tunnels, an edge
// gateway's tunnels). The old process's app offers them; the new one's
// hands each object of a participant's Kind to its Adopt.

// State is the process state a feature moves before any object: once the
// new process holds it, the new process serves; before, a failure leaves
// everything with the old one. One at most (the forwarder's).
type State struct {
	// Versions names the encodings of the state and of what the objects
	// share ("report 1, ktls 3"); each participant names its objects'
	// (Participant.Encoding). Two builds hand over only when all of them
	// are the same (Encodings).
	Versions string
	// Settle waits, in the old process once it stopped accepting, until
	// the connections it accepted before have finished opening (their
	// handshake, their preamble), or until deadline: a tunnel that opened
	// after the state moved would stand outside it. It reports whether
	// they did, and what is still opening as log fields.
	Settle func(deadline time.Time) (settled bool, opening []zap.Field)
	// Export encodes the state in the old process. done(true) says that
	// the new process holds it for good: the old one must not use it any
	// more (its report stream); done(false) that it does not: the old
	// one goes on with it.
	Export func() (state []byte, done func(handedOver bool), err error)
	// Adopt takes the state over in the new process; an error refuses it,
	// and the upgrade fails.
	Adopt func(state []byte) error
	// Ended runs in the new process once the handoff has ended, whatever
	// came of the objects: until then the old process may take the state
	// back (its report stream), so the new one must not act on it.
	Ended func()
}

var processState struct {
	mu  sync.Mutex
	set bool
	s   State
}

// RegisterState registers the process state; a second one panics.
func RegisterState(s State) {
	processState.mu.Lock()
	defer processState.mu.Unlock()
	if processState.set {
		panic("upgrade: a process state already registered")
	}
	processState.s, processState.set = s, true
}

// ProcessState returns the registered process state, false for none.
func ProcessState() (State, bool) {
	processState.mu.Lock()
	defer processState.mu.Unlock()
	return processState.s, processState.set
}

// The names of the forwarder's participants: their counts are
// UpgradeResponse's own fields (moved, standby_moved), every other
// participant's are under its name in the answer's others.
const (
	NameSandbox = "sandbox" // the forwarder's tunnels
	NameStandby = "standby" // the gateways' standby connections at a forwarder
)

// Participant is a feature's part in an upgrade.
type Participant struct {
	// Name names the feature in the handoff's answer (NameSandbox,
	// NameStandby, or a key of its others: "gateway").
	Name string
	// Kind is the handoff object kind it moves and adopts (internal/handoff).
	Kind uint16
	// Order places its Move among the others', lowest first (the
	// forwarder's standby connections before its tunnels: one whose first
	// preamble byte arrives as it moves opens a tunnel, which the tunnels'
	// Move then offers).
	Order int
	// Tunnels says its objects are tunnels: counted in
	// caddy_ktls_sandbox_handoff_tunnels_total, their pauses observed.
	Tunnels bool
	// Encoding names its objects' encoding and version ("tunnel 2"), for
	// Encodings.
	Encoding string
	// Noun names one of its objects in the logs ("tunnel", "standby
	// connection", "gateway tunnel").
	Noun string
	// StayMessage is the old process's log line for an object that stays,
	// StayKey the field that names it.
	StayMessage, StayKey string
	// MovedField and StayedField name its counts in the old process's log
	// line of the handoff, AdoptedField in the new one's.
	MovedField, StayedField, AdoptedField string
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

// Participants returns the registered participants in Order, those of
// one Order in order of registration.
func Participants() []Participant {
	participants.mu.Lock()
	defer participants.mu.Unlock()
	list := slices.Clone(participants.list)
	slices.SortStableFunc(list, func(a, b Participant) int { return cmp.Compare(a.Order, b.Order) })
	return list
}

// Encodings names the encodings of everything this build moves: the
// process state's Versions, then each participant's Encoding in Order.
// Two builds hand over only when theirs are the same.
func Encodings() string {
	s, _ := ProcessState()
	list := []string{s.Versions}
	for _, p := range Participants() {
		list = append(list, p.Encoding)
	}
	return strings.Join(slices.DeleteFunc(list, func(e string) bool { return e == "" }), ", ")
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

package handoff

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/listensock"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
)

// takeTunnels is step 2 of a new process; from is the process whose
// listeners it took.
func (h *Handoff) takeTunnels(from *handoff.Hello) {
	// Until the process state moved, a failure leaves everything with the
	// running process; this one shares its listening sockets and would
	// serve beside it, with a report stream of its own: it exits.
	failed := func(msg string, err error) {
		handoffs.WithLabelValues("new", "failed").Inc()
		h.logger.Error(msg+"; the upgrade failed: exiting, the running process serves on", zap.Error(err))
		os.Exit(1)
	}
	// A running process that died before its state moved took its
	// tunnels and state with it: this one serves as after a restart.
	alone := func(msg string, err error) {
		handoffs.WithLabelValues("new", "peer_died").Inc()
		h.logger.Error(msg+": this process serves as after a restart (a report stream of its own, empty replay caches); the tunnels of the process that died ended with it",
			zap.Int("pid", from.PID), zap.Error(err))
		listensock.ResumeAccepting()
	}
	r, err := handoff.Dial(h.Socket, h.config(wantTunnels))
	if noProcessAt(err) && syscall.Kill(from.PID, 0) == syscall.ESRCH {
		alone("the running process is gone", err)
		return
	}
	if err != nil {
		failed("cannot ask the running process for its tunnels", err)
		return
	}
	defer r.Close()
	peer := r.Peer()
	start := time.Now()
	it, err := r.Next()
	if err != nil {
		if r.PeerDied() {
			alone(fmt.Sprintf("the running process (pid %d) died before it handed its state over", peer.PID), err)
			return
		}
		failed(fmt.Sprintf("the running process (pid %d) sent no state", peer.PID), err)
		return
	}
	state, _ := upgrade.ProcessState()
	err = fmt.Errorf("object kind %d offered where the process state was expected", it.Kind)
	if it.Kind == handoff.KindProcess {
		err = state.Adopt(it.State)
	}
	if err != nil {
		it.Refuse(err.Error())
		failed(fmt.Sprintf("refused the state of the running process (pid %d)", peer.PID), err)
		return
	}
	if err := it.Adopt(); err != nil {
		// This process holds a copy of a state the old one goes on with
		// (its report stream): it must not act on it, so it must not run.
		failed(fmt.Sprintf("the running process (pid %d) kept its state after this one took it", peer.PID), err)
		return
	}
	// The state is this process's once the handoff has ended: until then
	// the running process takes it back if this one dies.
	defer state.Ended()
	handoffs.WithLabelValues("new", "done").Inc()
	listensock.ResumeAccepting()
	// As in the running process (sendTunnels), no collection while the
	// tunnels arrive.
	defer handoff.HoldCollection(handoff.CollectionHeadroom)()
	var mu sync.Mutex           // the counts: objects are built on several goroutines
	adopted := map[string]int{} // by participant
	refused := 0
	// Each object is built on a goroutine of its own, several at once as
	// the running process offers them, and adopted without waiting for
	// its verdict (AdoptThen), which the session's reading acts on. Once
	// Take returns every one has had its verdict.
	err = r.Take(func(it *handoff.Item) {
		kept := func() {
			mu.Lock()
			defer mu.Unlock()
			refused++
		}
		p, ok := upgrade.ForKind(it.Kind)
		if !ok {
			it.Refuse(fmt.Sprintf("object kind %d offered where tunnels were asked for", it.Kind))
			kept()
			return
		}
		moved := func() {
			mu.Lock()
			defer mu.Unlock()
			adopted[p.Name]++
		}
		adopt(h.logger, p, it, moved, kept)
	})
	if !errors.Is(err, handoff.ErrDone) {
		if r.PeerDied() {
			h.logger.Error("the running process died during the handoff: the tunnels it had not sent ended with it; this process serves on", zap.Int("pid", peer.PID), zap.Error(err))
		} else {
			h.logger.Error("the handoff ended early: the running process keeps the tunnels it did not send", zap.Int("pid", peer.PID), zap.Error(err))
		}
	}
	fields := []zap.Field{zap.Int("pid", peer.PID), zap.String("build", peer.Build)}
	tunnels := 0
	for _, p := range upgrade.Participants() {
		fields = append(fields, zap.Int(p.AdoptedField, adopted[p.Name]))
		if p.Tunnels {
			tunnels += adopted[p.Name]
		}
	}
	fields = append(fields, zap.Int("refused", refused), zap.Duration("duration", time.Since(start)))
	handoffTunnels.WithLabelValues("adopted").Add(float64(tunnels))
	handoffTunnels.WithLabelValues("refused").Add(float64(refused))
	h.logger.Info("took the running process's tunnels over", fields...)
}

// adopt takes an object of participant p over and runs it once the
// running process released it (moved counts it); a refusal, or the
// object kept, calls kept.
func adopt(logger *zap.Logger, p upgrade.Participant, it *handoff.Item, moved, kept func()) {
	defer it.Close() // the adopted object holds duplicates
	run, discard, err := p.Adopt(it.State, it.Files)
	if err != nil {
		it.Refuse(err.Error())
		logger.Warn("refused a "+p.Noun+" of the running process; it stays there", zap.Error(err))
		kept()
		return
	}
	drop := func() { discard(); kept() }
	if err := it.AdoptThen(func() { moved(); go run() }, drop); err != nil {
		drop()
	}
}

package handoff

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/listensock"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
)

// sender serves the handoff socket in the old process, one session at a
// time.
type sender struct {
	ln     *net.UnixListener
	logger *zap.Logger
	cfg    atomic.Pointer[handoff.Config] // the latest configuration's
	done   chan struct{}
}

func (s *sender) Destruct() error {
	err := s.ln.Close()
	<-s.done
	return err
}

func (s *sender) loop() {
	defer close(s.done)
	for {
		sess, err := handoff.Accept(s.ln, *s.cfg.Load())
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			s.logger.Warn("refused a process that asked to take over", zap.Error(err))
			handoffs.WithLabelValues("old", "failed").Inc()
			upgrades.publish(UpgradeResponse{Error: "refused the new process: " + err.Error()})
			continue
		}
		peer := sess.Peer()
		switch peer.Want {
		case wantListeners:
			s.sendListeners(sess)
		case wantTunnels:
			out := s.sendTunnels(sess)
			acked := upgrades.publish(out)
			if out.Error == "" {
				// The answer to POST /sandbox/upgrade goes out before
				// this process begins to exit.
				select {
				case <-acked:
				case <-time.After(2 * time.Second):
				}
				s.exit(peer)
				return
			}
		default:
			sess.Close()
			s.logger.Warn("refused a process that asked to take over: it asked for nothing this build hands over", zap.Int("pid", peer.PID), zap.String("want", peer.Want))
		}
	}
}

// sendListeners offers a duplicate of every tcp-handoff listening socket;
// this process goes on accepting from them.
func (s *sender) sendListeners(sess *handoff.Sender) {
	defer sess.Close()
	peer := sess.Peer()
	exported, err := listensock.Export()
	if err != nil {
		s.logger.Error("cannot hand the listening sockets over", zap.Int("pid", peer.PID), zap.Error(err))
		return
	}
	var moved []string
	for i, e := range exported {
		fate, err := sess.Move(handoff.KindListener, []byte(e.Address), e.File)
		e.File.Close()
		if fate != handoff.Moved {
			s.logger.Warn("the new process did not take a listening socket", zap.Int("pid", peer.PID), zap.String("address", e.Address), zap.Error(err))
			if !errors.As(err, new(*handoff.RefusedError)) {
				for _, rest := range exported[i+1:] {
					rest.File.Close()
				}
				return
			}
			continue
		}
		moved = append(moved, e.Address)
	}
	s.logger.Info("a new process shares the listening sockets; this process goes on accepting until it takes the tunnels over",
		zap.Int("pid", peer.PID), zap.String("build", peer.Build), zap.Strings("listeners", moved))
}

// sendTunnels is step 2 on the old side. Its answer has no Error when the
// process state moved: the new process serves from then on.
func (s *sender) sendTunnels(sess *handoff.Sender) UpgradeResponse {
	defer sess.Close()
	peer := sess.Peer()
	start := time.Now()
	out := UpgradeResponse{PID: peer.PID, Build: peer.Build}
	s.logger.Info("the new process asks for the tunnels: this process stops accepting, then hands its state and tunnels over",
		zap.Int("pid", peer.PID), zap.String("build", peer.Build))
	listensock.StopAccepting()
	state, _ := upgrade.ProcessState()
	if settled, opening := state.Settle(time.Now().Add(settleFor)); !settled {
		s.logger.Warn("connections accepted before this process stopped accepting are still in their handshake or preamble; they stay here",
			append([]zap.Field{zap.Duration("waited", settleFor)}, opening...)...)
	}
	// No collection while the state and the tunnels move (a collection
	// stops every relay behind it), up to a memory limit.
	defer handoff.HoldCollection(handoff.CollectionHeadroom)()
	result := "failed"
	giveUp := func(msg string, err error) UpgradeResponse {
		listensock.ResumeAccepting()
		s.logger.Error(msg+": this process goes on serving every tunnel it holds and accepting", zap.Int("pid", peer.PID), zap.Error(err))
		handoffs.WithLabelValues("old", result).Inc()
		out.Error = fmt.Sprintf("%s: %v", msg, err)
		return out
	}
	b, done, err := state.Export()
	if err != nil {
		return giveUp("cannot hand the process state over", err)
	}
	if fate, err := sess.Move(handoff.KindProcess, b); fate != handoff.Moved {
		done(false)
		return giveUp("the new process did not take the process state over", err)
	}
	moved := moveParticipants(sess)
	out.count(moved)
	// What moved and stayed of the tunnels, every participant's together.
	tunnelsMoved, stayed := 0, 0
	var pauses []time.Duration
	for _, m := range moved {
		if m.p.Tunnels {
			tunnelsMoved += m.res.Moved
			stayed += len(m.res.Stays)
			pauses = append(pauses, m.res.Pauses...)
		}
	}
	if err := sess.Finish(); err != nil && sess.PeerDied() {
		// The new process died with what it took: the tunnels that moved
		// ended with it; it acted on nothing of the state (a process acts
		// on an adopted state only once the handoff ended: State.Ended),
		// so this process takes it back, and serves on.
		done(false)
		result = "peer_died"
		return giveUp(fmt.Sprintf("the new process died during the handoff; the %d tunnels it had taken ended with it", tunnelsMoved), err)
	}
	// The new process is the service's from now on: under systemd, the
	// main process says so (NotifyAccess=main takes it from no other),
	// and its own exit, and STOPPING=1, concern the service no more.
	notifyMainPID(s.logger, peer.PID)
	done(true)
	upgrade.HandedOver()
	handoffs.WithLabelValues("old", "done").Inc()
	handoffTunnels.WithLabelValues("moved").Add(float64(tunnelsMoved))
	handoffTunnels.WithLabelValues("stayed").Add(float64(stayed))
	for _, p := range pauses {
		handoffPause.Observe(p.Seconds())
	}
	out.Duration = caddy.Duration(time.Since(start))
	slices.Sort(pauses)
	fields := []zap.Field{zap.Int("pid", peer.PID), zap.String("build", peer.Build)}
	for _, m := range moved {
		fields = append(fields, zap.Int(m.p.MovedField, m.res.Moved), zap.Any(m.p.StayedField, m.res.Stayed))
	}
	fields = append(fields, zap.Duration("duration", time.Since(start)))
	if n := len(pauses); n > 0 {
		p50, p99, pmax := pauses[n/2], pauses[(n*99)/100], pauses[n-1]
		out.PauseP99, out.PauseMax = caddy.Duration(p99), caddy.Duration(pmax)
		fields = append(fields, zap.Duration("pause_p50", p50), zap.Duration("pause_p99", p99), zap.Duration("pause_max", pmax))
	}
	s.logger.Info("handed the tunnels over to the new process", fields...)
	for _, m := range moved {
		for _, st := range m.res.Stays {
			s.logger.Info(m.p.StayMessage, zap.String(m.p.StayKey, st.Object), zap.String("why", st.Why), zap.Error(st.Err))
		}
	}
	return out
}

// participantMoved is what a registered participant's Move did.
type participantMoved struct {
	p   upgrade.Participant
	res handoff.MoveResult[string]
}

// moveParticipants offers every registered participant's objects, in
// their order.
func moveParticipants(sess *handoff.Sender) []participantMoved {
	var out []participantMoved
	for _, p := range upgrade.Participants() {
		out = append(out, participantMoved{p, p.Move(context.Background(), handoff.SenderMover(sess))})
	}
	return out
}

// settleFor bounds the old process's wait for the connections it accepted
// before it stopped accepting to finish their handshake and open their
// tunnel (handshake_timeout and preamble_timeout bound each).
const settleFor = 10 * time.Second

// exit ends the old process as SIGTERM does, once the tunnels moved: the
// ones that stayed drain for drain_grace_period.
func (s *sender) exit(peer handoff.Hello) {
	s.logger.Info("exiting: the new process serves from now on", zap.Int("pid", peer.PID))
	syscall.Kill(os.Getpid(), syscall.SIGTERM)
}

// notifyMainPID tells systemd, when it supervises this process
// (NOTIFY_SOCKET), that pid is the service's main process now.
func notifyMainPID(logger *zap.Logger, pid int) {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return
	}
	if strings.HasPrefix(path, "@") {
		path = "\x00" + path[1:]
	}
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err == nil {
		_, err = fmt.Fprintf(c, "MAINPID=%d", pid)
		c.Close()
	}
	if err != nil {
		logger.Warn("cannot tell systemd that the new process is the service's main process (NOTIFY_SOCKET): its exit will stop the service", zap.Int("pid", pid), zap.Error(err))
	}
}

package upgrade

import (
	"context"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/internal/listensock"
)

// Once a handoff has ended, the old process accepts nothing more: every
// connection it holds on a handed-over listener is one it accepted before
// the switch, whatever step it is in (caddy-l4's matching, a TLS
// handshake, a preamble not read yet, a standby connection, a tunnel that
// could not move). Its gateway dialed this process and cannot be told to
// go elsewhere: it is served to its end here, its tunnel opened, not
// refused as draining. At exit the features wait for them
// (ServeAccepted) before their drain, within the same grace period.

var handedOver atomic.Bool

// HandedOver marks this process as one that handed its listeners and
// state over to a new process: it accepts no more (the sandbox_handoff
// app calls it once the new process took over).
func HandedOver() { handedOver.Store(true) }

// ServeAccepted first counts the connections held after acceptedPoll,
// then waits twice as long between counts up to acceptedPollMax: a count
// reads every descriptor of the process, thousands where tunnels stayed.
const (
	acceptedPoll    = 50 * time.Millisecond
	acceptedPollMax = time.Second
)

// ServeAccepted, in a process that handed over, waits until it holds no
// connection accepted from the handed-over listeners (listensock.Held),
// or until ctx is done; it returns how many it still held then (the
// process closes them as it exits). Elsewhere it returns 0 at once. Each
// feature calls it at exit before its own drain, which then finds only
// what the grace period cut short.
func ServeAccepted(ctx context.Context, logger *zap.Logger) (left int) {
	if !handedOver.Load() {
		return 0
	}
	n, err := listensock.Held()
	if err != nil {
		logger.Warn("cannot count the connections accepted before the handoff: those still before their tunnel are refused as draining", zap.Error(err))
		return 0
	}
	if n == 0 {
		return 0
	}
	start := time.Now()
	logger.Info("serving the connections accepted before the handoff to their end: their tunnels open here; this process exits once it holds none, or when the grace period ends",
		zap.Int("connections", n))
	wait := acceptedPoll
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			n, _ = listensock.Held()
			if n > 0 {
				logger.Warn("connections accepted before the handoff are still open at the end of the grace period: tunnels among them are closed by the drain, the others as this process exits",
					zap.Int("connections", n), zap.Duration("waited", time.Since(start)))
			}
			return n
		case <-t.C:
		}
		if n, err = listensock.Held(); err == nil && n == 0 {
			logger.Info("served every connection accepted before the handoff", zap.Duration("waited", time.Since(start)))
			return 0
		}
		wait = min(2*wait, acceptedPollMax)
		t.Reset(wait)
	}
}

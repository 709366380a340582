package forwarder

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/offload"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/preamble"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// The forwarder's part in a binary upgrade (the sandbox_handoff app,
// modules/handoff). Its process state moves first: the activity-report
// stream with every sandbox's counters, the preamble replay caches,
// Close's refusals, the bandwidth buckets. Then its gateways' standby
// connections, then every tunnel it can: those whose gateway session runs
// in kernel TLS, paused at a safe point. A tunnel still opening is offered
// again until it is open or movePassesFor has passed. The new process
// adopts a tunnel in the sandbox handler that trusts the key that signed
// its preamble, a standby connection in the handler configured as the one
// it waited in.

func init() {
	upgrade.RegisterState(upgrade.State{
		Versions: stateVersions,
		Settle:   settle,
		Export:   exportProcess,
		Adopt:    adoptProcess,
		Ended:    func() { tunnels.ResumeReports() },
	})
	upgrade.Register(upgrade.Participant{
		Name:         upgrade.NameStandby,
		Kind:         handoff.KindStandby,
		Order:        0,
		Encoding:     fmt.Sprintf("standby %d", forward.MovedStandbyVersion),
		Noun:         "standby connection",
		StayMessage:  "sandbox standby connection stays in this process until its preamble, its standby_timeout or the drain",
		StayKey:      "peer",
		MovedField:   "standby_moved",
		StayedField:  "standby_stayed",
		AdoptedField: "standby",
		Move: func(ctx context.Context, m handoff.Mover) handoff.MoveResult[string] {
			return tunnels.MoveStandby(ctx, m)
		},
		Adopt: adoptStandby,
	})
	upgrade.Register(upgrade.Participant{
		Name:         upgrade.NameSandbox,
		Kind:         handoff.KindTunnel,
		Order:        1,
		Tunnels:      true,
		Encoding:     fmt.Sprintf("tunnel %d", forward.MovedTunnelVersion),
		Noun:         "tunnel",
		StayMessage:  "sandbox tunnel stays in this process until it ends or the drain ends it",
		StayKey:      "id",
		MovedField:   "moved",
		StayedField:  "stayed",
		AdoptedField: "tunnels",
		Move:         moveTunnels,
		Adopt:        adoptTunnel,
	})
}

// movePassesFor bounds how long the old process offers again the tunnels
// that were still opening (handshake, preamble, dial) when it offered them.
const movePassesFor = 2 * time.Second

// processStateVersion is processState.Version as this build writes it.
const processStateVersion = 1

// processState is what moves before the tunnels.
type processState struct {
	Version int                 `json:"version"`
	Reports forward.ReportState `json:"reports"`
	Replay  []replayState       `json:"replay,omitempty"`
}

// replayState is one replay cache's nonces (preamble.ReplayState's binary
// encoding).
type replayState struct {
	Size   int           `json:"size"`
	Window time.Duration `json:"window"`
	Nonces []byte        `json:"nonces"`
}

// stateVersions names the encodings of the process state and of what
// every moved object carries (a session's state, a relay's); the
// participants name their objects' (upgrade.Encodings).
var stateVersions = fmt.Sprintf("report %d, process %d, ktls %d, pause %d",
	forward.ReportStateVersion, processStateVersion, ktls.HandoffVersion, splice.PauseVersion)

// settle waits until no connection of this process is in its TLS
// handshake or between it and its tunnel, but for the standby connections
// waiting for their first preamble byte, or until deadline; it reports
// whether they settled, and what was still opening. A tunnel that opens
// after the report stream moved would not belong to it: it could not
// move.
func settle(deadline time.Time) (bool, []zap.Field) {
	for {
		waiting, _ := tunnels.Standby()
		if offload.HandshakesInProgress.Load() == 0 && tunnels.Opening() <= int64(waiting) {
			return true, nil
		}
		if time.Now().After(deadline) {
			return false, []zap.Field{zap.Int64("handshakes", offload.HandshakesInProgress.Load()), zap.Int64("opening", tunnels.Opening())}
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// exportProcess encodes the process state; done says whether the new
// process took it (forward.Registry.HandOff).
func exportProcess() ([]byte, func(bool), error) {
	reports, done, err := tunnels.HandOff()
	if err != nil {
		return nil, nil, fmt.Errorf("the activity reports: %w", err)
	}
	replay, err := replayStates(time.Now())
	if err != nil {
		done(false)
		return nil, nil, fmt.Errorf("the replay caches: %w", err)
	}
	state, err := json.Marshal(processState{Version: processStateVersion, Reports: reports, Replay: replay})
	if err != nil {
		done(false)
		return nil, nil, err
	}
	return state, done, nil
}

// moveTunnels offers every open tunnel, then again those still opening,
// until none is left or movePassesFor has passed.
func moveTunnels(ctx context.Context, m handoff.Mover) handoff.MoveResult[string] {
	var total handoff.MoveResult[uint64]
	deadline := time.Now().Add(movePassesFor)
	for {
		res := tunnels.MoveTunnels(ctx, m)
		total.Moved += res.Moved
		total.Pauses = append(total.Pauses, res.Pauses...)
		total.Stayed, total.Stays = res.Stayed, res.Stays
		if res.Stayed[handoff.StayNotMovable] == 0 || res.Stayed[handoff.StayRefused] > 0 || time.Now().After(deadline) {
			out := handoff.MoveResult[string]{Moved: total.Moved, Stayed: total.Stayed, Pauses: total.Pauses}
			for _, s := range total.Stays {
				out.Stays = append(out.Stays, handoff.Stay[string]{Object: strconv.FormatUint(s.Object, 10), Why: s.Why, Err: s.Err})
			}
			return out
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// replayStates exports every replay cache in use; a cache left out would
// let its nonces be replayed in the new process, so any failure fails all.
func replayStates(now time.Time) ([]replayState, error) {
	var out []replayState
	var err error
	replayCaches.Range(func(k, v any) bool {
		key := k.(replayCacheKey)
		var b []byte
		if b, err = v.(replayCacheEntry).State(now).MarshalBinary(); err != nil {
			return false
		}
		out = append(out, replayState{Size: key.size, Window: key.window, Nonces: b})
		return true
	})
	return out, err
}

// adoptStandby builds a gateway's standby connection, served once the
// running process released it, in the sandbox handler configured as the
// one it waited in (moveNameOf), else in the configuration's only one. A
// standby connection names no key that would choose a handler: where
// neither exists, it is refused, and stays in the old process until its
// preamble, its standby_timeout or that process's drain.
func adoptStandby(state []byte, files []*os.File) (run, discard func(), err error) {
	ms, err := forward.DecodeMovedStandby(state)
	if err != nil {
		return nil, nil, err
	}
	hd := keyrings.named(ms.Forwarder)
	if hd == nil {
		var n int
		if hd, n = keyrings.only(); hd == nil {
			clear(ms.Conn) // the session's secrets
			return nil, nil, fmt.Errorf("%d sandbox handlers in this configuration, none configured as the one the standby connection waited in: before its preamble, it names no key to choose one by", n)
		}
	}
	a, err := hd.fwd.AdoptStandby(ms, files)
	if err != nil {
		return nil, nil, err
	}
	return func() { hd.serveAdopted(a) }, a.Discard, nil
}

// adoptProcess takes the old process's state: its replay caches' nonces
// into every cache this configuration uses, then its report stream.
func adoptProcess(state []byte) error {
	var ps processState
	if err := json.Unmarshal(state, &ps); err != nil {
		return fmt.Errorf("process state: %w", err)
	}
	if ps.Version != processStateVersion {
		return fmt.Errorf("process state version %d, this build takes %d", ps.Version, processStateVersion)
	}
	now := time.Now()
	for _, rs := range ps.Replay {
		var st preamble.ReplayState
		if err := st.UnmarshalBinary(rs.Nonces); err != nil {
			return fmt.Errorf("replay cache (%d nonces, window %v): %w", rs.Size, rs.Window, err)
		}
		var rerr error
		replayCaches.Range(func(_, v any) bool {
			rerr = v.(replayCacheEntry).Restore(st, now)
			return rerr == nil
		})
		if rerr != nil {
			return fmt.Errorf("replay cache (%d nonces, window %v): %w", rs.Size, rs.Window, rerr)
		}
	}
	if err := tunnels.AdoptReports(ps.Reports); err != nil {
		return fmt.Errorf("%w (a listener of this configuration that is no tcp-handoff/ address accepts tunnels before the state is here: listen on tcp-handoff/ addresses only)", err)
	}
	return nil
}

// adoptTunnel builds a moved tunnel in the sandbox handler that trusts the
// key that signed its preamble; run carries it to its end there.
func adoptTunnel(state []byte, files []*os.File) (run, discard func(), err error) {
	mt, err := forward.DecodeMovedTunnel(state)
	if err != nil {
		return nil, nil, err
	}
	hd := keyrings.handlerTrusting(mt.Tunnel.KeyID, mt.Tunnel.Key)
	if hd == nil {
		clear(mt.Conn) // the session's secrets
		return nil, nil, fmt.Errorf("moved tunnel %d: no sandbox handler of this configuration trusts its key %q", mt.Tunnel.ID, mt.Tunnel.KeyID)
	}
	a, err := hd.fwd.Adopt(mt, files)
	if err != nil {
		return nil, nil, err
	}
	return func() {
		res, err := a.Run()
		hd.tunnelEnded(res, err)
	}, a.Discard, nil
}

package edgegateway

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/gateway"
	"github.com/ktlsingress/caddy-ktls/internal/handoff"
	"github.com/ktlsingress/caddy-ktls/internal/upgrade"
)

// The sandbox_proxy handlers' part in a binary upgrade (the
// sandbox_handoff app): the old process offers the tunnels of every
// provisioned handler's Dialer, the new one adopts each in the handler
// configured as the one it ran in (its move name), else in the
// configuration's only one, else refuses it: it then runs on in the old
// process until it ends or that process's drain ends it.

func init() {
	upgrade.Register(upgrade.Participant{
		Name:         "gateway",
		Kind:         handoff.KindGatewayTunnel,
		Order:        2, // after the forwarder's, in a process with both
		Tunnels:      true,
		Encoding:     fmt.Sprintf("gateway tunnel %d", gateway.MovedTunnelVersion),
		Noun:         "gateway tunnel",
		StayMessage:  "gateway tunnel stays in this process until it ends or the drain ends it",
		StayKey:      "tunnel",
		MovedField:   "gateway_moved",
		StayedField:  "gateway_stayed",
		AdoptedField: "gateway_tunnels",
		Move:         proxies.move,
		Adopt:        proxies.adopt,
	})
}

// moveNameOf names a sandbox_proxy handler for an upgrade
// (upgrade.MoveName), as modules/forwarder names its sandbox handlers.
func moveNameOf(h *Proxy) (string, error) { return upgrade.MoveName(h) }

// proxies are the provisioned sandbox_proxy handlers of the process, from
// Provision until Cleanup, and after it for as long as their Dialer
// carries a tunnel: tunnels outlive a reload, and must move all the same.
var proxies proxyRegistry

type proxyRegistry struct {
	mu      sync.Mutex
	list    []*Proxy
	retired map[*Proxy]bool // cleaned up: their tunnels move, nothing is adopted in them
	// exitDrain is closed once the drain at exit ended, which the first
	// handler's Cleanup at exit begins (drainAtExit); nil before.
	exitDrain chan struct{}
}

func (r *proxyRegistry) add(h *Proxy) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.list = append(r.list, h)
}

// retire marks h cleaned up: it stays while its Dialer carries tunnels.
func (r *proxyRegistry) retire(h *Proxy) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.retired == nil {
		r.retired = map[*Proxy]bool{}
	}
	r.retired[h] = true
	r.pruneLocked()
}

// pruneLocked drops the retired handlers whose Dialer carries no tunnel.
func (r *proxyRegistry) pruneLocked() {
	r.list = slices.DeleteFunc(r.list, func(p *Proxy) bool {
		if r.retired[p] && p.dialer.Tunnels() == 0 {
			delete(r.retired, p)
			return true
		}
		return false
	})
}

// snapshot returns the registered handlers; live leaves the retired ones
// out.
func (r *proxyRegistry) snapshot(live bool) []*Proxy {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pruneLocked()
	if !live {
		return slices.Clone(r.list)
	}
	return slices.DeleteFunc(slices.Clone(r.list), func(p *Proxy) bool { return r.retired[p] })
}

// move offers every tunnel of every handler's Dialer to m.
func (r *proxyRegistry) move(ctx context.Context, m handoff.Mover) handoff.MoveResult[string] {
	var out handoff.MoveResult[string]
	for _, h := range r.snapshot(false) {
		res := h.dialer.MoveTunnels(ctx, m)
		out.Moved += res.Moved
		out.Pauses = append(out.Pauses, res.Pauses...)
		for _, st := range res.Stays {
			out.Stay(handoff.Stay[string]{Object: st.Object.String(), Why: st.Why, Err: st.Err})
		}
	}
	return out
}

// handlerFor returns the handler of the running configuration that adopts
// a tunnel moved by the handler named name: the one of that name, else the
// only one; nil and how many there are for none.
func (r *proxyRegistry) handlerFor(name string) (*Proxy, int) {
	list := r.snapshot(true)
	if i := slices.IndexFunc(list, func(h *Proxy) bool { return name != "" && h.moveName == name }); i >= 0 {
		return list[i], len(list)
	}
	if len(list) == 1 {
		return list[0], 1
	}
	return nil, len(list)
}

// adopt builds a moved tunnel in the handler handlerFor names; run carries
// it to its end with that handler's logs and metrics.
func (r *proxyRegistry) adopt(state []byte, files []*os.File) (run, discard func(), err error) {
	mt, err := gateway.DecodeMovedTunnel(state)
	if err != nil {
		return nil, nil, err
	}
	h, n := r.handlerFor(mt.Dialer)
	if h == nil {
		clear(mt.User) // the sessions' secrets
		clear(mt.Tunnel)
		return nil, nil, fmt.Errorf("moved gateway tunnel: %d sandbox_proxy handlers in this configuration, none configured as the one the tunnel ran in", n)
	}
	a, err := h.dialer.AdoptTunnel(mt, files)
	if err != nil {
		return nil, nil, err
	}
	run = func() {
		h.handling.enter()
		defer h.handling.leave()
		where := tunnelFields(a.Route.Client.Addr.String(), a.Route)
		st, end, err := a.Run(h.onDial(where))
		h.tunnelEnded(where, st, end, err)
	}
	return run, a.Discard, nil
}

// drainAtExit drains, at process exit, the Dialers of every handler
// registered (the retired ones that still carry tunnels as well) within
// one grace period: h's, the first handler cleaned up at exit (still
// registered: its Cleanup retires it after), which runs the drain. The
// others' Cleanup wait for it to end, so that the grace periods of
// several handlers never add up. From the drain on, new tunnels are
// refused; those still open when the period ends are closed and counted
// (caddy_ktls_gateway_tunnel_ends_total{end="drained"}). A reload must
// never call it.
func (r *proxyRegistry) drainAtExit(h *Proxy) {
	r.mu.Lock()
	if done := r.exitDrain; done != nil {
		r.mu.Unlock()
		<-done
		return
	}
	done := make(chan struct{})
	r.exitDrain = done
	list := slices.Clone(r.list)
	r.mu.Unlock()
	defer close(done)

	grace := time.Duration(h.DrainGracePeriod)
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	// After a handoff, the user connections accepted before it are
	// served first, their tunnels dialed, within the same grace period.
	upgrade.ServeAccepted(ctx, h.logger)
	open := 0
	for _, p := range list {
		open += p.dialer.Tunnels()
	}
	if open > 0 {
		h.logger.Info("draining open tunnels at exit: new tunnels are refused, open ones may finish until the grace period ends",
			zap.Int("tunnels", open), zap.Duration("grace_period", grace), zap.Int("handlers", len(list)))
	}
	var forced atomic.Int64
	var wg sync.WaitGroup
	for _, p := range list {
		wg.Go(func() {
			forced.Add(int64(p.dialer.Drain(ctx)))
			// Every tunnel's Carry has returned: what remains of its
			// Handle counts and logs its end.
			p.handling.wait()
		})
	}
	wg.Wait()
	if n := forced.Load(); n > 0 {
		h.logger.Warn("closed tunnels still open after the drain grace period", zap.Int64("tunnels", n), zap.Duration("grace_period", grace))
	}
}

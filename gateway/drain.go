package gateway

import (
	"context"
	"errors"
)

// ErrDraining is the error of a Carry that starts while its Dialer drains
// (Drain): the user's connection is ended as refused, nothing is dialed
// and nothing reaches a sandbox.
var ErrDraining = errors.New("gateway: the gateway is draining before exit: no new tunnel is opened")

// ErrDrained is the cause of a tunnel's end when Drain's grace period
// ended while it ran: its Carry (or AdoptedTunnel Run) returns EndDrained
// and an error that wraps it.
var ErrDrained = errors.New("gateway: the drain's grace period ended: tunnel closed")

// Drain prepares d's process to exit without cutting a tunnel it need not
// cut. From the call on a Carry is refused (ErrDraining) and d keeps no
// standby connection. Drain waits for every tunnel d carries to end: those
// Carry carries, from their dial, and those AdoptedTunnel Run carries.
// When ctx is done first it ends the ones still running as failures (the
// relay's cancel: neither side takes the cut stream for a complete one;
// their Carry returns EndDrained and ErrDrained), a dial still in
// progress fails, and Drain waits for every Carry and Run to return. It
// returns how many tunnels it ended so.
//
// A tunnel paused for a move (MoveTunnels) is not cut while paused: it
// moves whole, or ends once it resumed here. A tunnel that moved no longer
// counts. Drain is meant for process exit: a reload must never drain.
func (d *Dialer) Drain(ctx context.Context) (forced int) {
	r := &d.tunnels
	r.mu.Lock()
	r.draining = true
	r.mu.Unlock()
	d.standby.close()
	if idle := r.idleChan(); idle != nil {
		select {
		case <-idle:
		case <-ctx.Done():
			r.mu.Lock()
			r.forceLocked()
			cancel := r.forceCancel
			r.mu.Unlock()
			cancel(ErrDrained)
			if idle := r.idleChan(); idle != nil {
				<-idle
			}
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.drained
}

// idleChan returns the channel closed when no Carry or Run runs any
// more, nil when none runs now.
func (r *registry) idleChan() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.running == 0 {
		return nil
	}
	if r.idle == nil {
		r.idle = make(chan struct{})
	}
	return r.idle
}

// countDrained counts a relay ended by the drain's deadline.
func (r *registry) countDrained() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.drained++
}

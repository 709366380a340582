package ktls

import (
	"sync"
	"sync/atomic"
)

// StatsSnapshot is a copy of the process-wide counters.
type StatsSnapshot struct {
	TX, RX           map[Mode]uint64   // connections with that direction in each mode
	Outcomes         map[Reason]uint64 // handshakes by Reason (ReasonNone = fully offloaded)
	ControlRecords   map[string]uint64 // received control records by type ("alert", "handshake", ...)
	KeyUpdates       uint64            // KeyUpdates applied
	KeyUpdatesSent   uint64            // KeyUpdates sent (our TX key renewed: requested by the peer or at Options.RecordLimit)
	KeyExhausted     uint64            // connections failed with ErrKeyExhausted
	RateLimitedClose uint64            // connections closed for exceeding KeyUpdateLimit
	ClosedAfterTX    uint64            // connections closed because a step after TLS_TX failed
	TicketsKept      uint64            // TLS 1.3 session tickets an offloaded client passed to its session cache
	TicketsDropped   uint64            // TLS 1.3 session tickets crypto/tls refused from an offloaded client
	HandedOff        uint64            // connections handed off to another owner (Handoff)
	HandoffRefused   uint64            // Handoff calls refused (the connection stayed)
	Adopted          uint64            // connections taken over from another owner (Adopt)
	// PartialRecordRetries: reads of a kernel RX socket woken after a
	// wait with part of a record queued, to ask again, which a collapsed
	// receive window needs (partial.go).
	PartialRecordRetries uint64
}

type counters struct {
	mu       sync.Mutex
	tx, rx   map[Mode]uint64
	outcomes map[Reason]uint64
	control  map[string]uint64

	keyUpdates, keyUpdatesSent, keyExhausted, rateLimited, closedAfterTX, ticketsKept, ticketsDropped atomic.Uint64
	handedOff, handoffRefused, adopted, partialRecordRetries                                          atomic.Uint64
}

var stats = counters{tx: map[Mode]uint64{}, rx: map[Mode]uint64{}, outcomes: map[Reason]uint64{}, control: map[string]uint64{}}

// Stats returns the process-wide counters.
func Stats() StatsSnapshot {
	stats.mu.Lock()
	defer stats.mu.Unlock()
	s := StatsSnapshot{
		TX: map[Mode]uint64{}, RX: map[Mode]uint64{}, Outcomes: map[Reason]uint64{}, ControlRecords: map[string]uint64{},
		KeyUpdates: stats.keyUpdates.Load(), KeyUpdatesSent: stats.keyUpdatesSent.Load(), KeyExhausted: stats.keyExhausted.Load(),
		RateLimitedClose: stats.rateLimited.Load(), ClosedAfterTX: stats.closedAfterTX.Load(),
		TicketsKept: stats.ticketsKept.Load(), TicketsDropped: stats.ticketsDropped.Load(),
		HandedOff: stats.handedOff.Load(), HandoffRefused: stats.handoffRefused.Load(), Adopted: stats.adopted.Load(),
		PartialRecordRetries: stats.partialRecordRetries.Load(),
	}
	for k, v := range stats.tx {
		s.TX[k] = v
	}
	for k, v := range stats.rx {
		s.RX[k] = v
	}
	for k, v := range stats.outcomes {
		s.Outcomes[k] = v
	}
	for k, v := range stats.control {
		s.ControlRecords[k] = v
	}
	return s
}

func countOutcome(o Offload) {
	stats.mu.Lock()
	defer stats.mu.Unlock()
	stats.outcomes[o.Reason]++
	if o.Reason != ReasonHandshakeFailed {
		stats.tx[o.TX]++
		stats.rx[o.RX]++
	}
}

func countControl(kind string) {
	stats.mu.Lock()
	stats.control[kind]++
	stats.mu.Unlock()
}

package ktls

import (
	"net"
	"time"
)

// EventKind names what an Event reports.
type EventKind string

// Event kinds.
const (
	EventHandshake   EventKind = "handshake"       // outcome of the handshake and offload (once per connection)
	EventKeyUpdate   EventKind = "key-update"      // the peer's KeyUpdate was applied
	EventRateLimited EventKind = "rate-limited"    // closed: control records above Options.KeyUpdateLimit
	EventAlert       EventKind = "alert"           // the peer sent a fatal alert
	EventClosed      EventKind = "closed-after-tx" // closed because a step after installing TX failed
	// closed: the peer sent a KeyUpdate and this kernel cannot install a
	// second key (ErrRekeyUnsupported, Linux < 6.14)
	EventRekeyUnsupported EventKind = "rekey-unsupported"
	// failed: a traffic key reached Options.RecordLimit and could not be
	// renewed (ErrKeyExhausted: TLS 1.2, Linux < 6.14, or a peer that did
	// not update when asked)
	EventKeyExhausted EventKind = "key-exhausted"
	// closed as refused: Options.RequireOffload and the session could not
	// be offloaded (Err is the *OffloadError)
	EventRefused EventKind = "refused"
)

// Event is passed to Options.Observer.
type Event struct {
	Kind    EventKind
	Offload Offload
	Remote  net.Addr
	Err     error
	// Duration, for EventHandshake only, is how long the handshake took:
	// from the start of the TLS handshake to the end of the offload (the
	// keys installed in the kernel, or the reason they were not), failed
	// handshakes included (Offload.Reason is ReasonHandshakeFailed: up to
	// the handshake's context deadline). Zero for the other kinds.
	Duration time.Duration
}

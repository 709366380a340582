package ktls

import (
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Options says how a connection may be offloaded. The zero value puts TX and
// RX in the kernel and allows the userspace fallback.
type Options struct {
	// Disable keeps the whole session in userspace crypto/tls, as on a
	// kernel without kTLS: for side-by-side measurements and as an escape
	// hatch from a kernel kTLS bug without changing the rest of the
	// configuration. The outcome is reported with ReasonDisabled.
	Disable bool
	// DisableRX keeps receive in userspace: incoming records are decrypted
	// in Go with the captured keys while the kernel seals outgoing ones.
	// The RX path (strparser, async decrypt) is where kTLS CVEs cluster.
	DisableRX bool
	// RequireOffload forbids the userspace fallback: the handshake fails
	// with an error naming the reason.
	RequireOffload bool
	// ExpectNoPad sets TLS_RX_EXPECT_NO_PAD (TLS 1.3 RX): the kernel
	// decrypts straight into the user buffer. Opt-in because a peer that
	// pads makes every record decrypt twice: trusted peers only.
	ExpectNoPad bool
	// TXZeroCopyRO sets TLS_TX_ZEROCOPY_RO: sendfile pages go to the NIC
	// without a copy. Opt-in because it only helps device offload, and a
	// file that changes while in flight makes retransmitted records fail
	// authentication at the peer.
	TXZeroCopyRO bool
	// KeyUpdateLimit bounds control records (KeyUpdate) per connection; a
	// peer above it is disconnected. Zero value: DefaultKeyUpdateLimit.
	KeyUpdateLimit Rate
	// Observer is called once per connection with the handshake outcome and
	// for notable later events. It must not block.
	Observer func(Event)
}

// Rate is a token bucket: PerSecond tokens refill per second, up to Burst.
type Rate struct {
	PerSecond float64
	Burst     int
}

// DefaultKeyUpdateLimit is the KeyUpdate rate a connection tolerates when
// Options.KeyUpdateLimit is the zero value.
var DefaultKeyUpdateLimit = Rate{PerSecond: 10, Burst: 20}

// Reason says why a connection is not (fully) offloaded. The set is fixed.
// When several apply, the first in this order is reported: disabled,
// version, cipher, buffered-bytes, not-tcp, key-capture (the connection's
// own), then no-kernel-support, cipher (refused by this kernel),
// setsockopt-ulp, setsockopt-tx, setsockopt-rx (the kernel's answers).
type Reason string

// The reasons.
const (
	ReasonNone            Reason = "none"              // TX and RX in the kernel as asked
	ReasonRXDisabled      Reason = "rx-disabled"       // TX in the kernel, RX in userspace by Options.DisableRX
	ReasonDisabled        Reason = "disabled"          // TX and RX in userspace by Options.Disable
	ReasonNoKernelSupport Reason = "no-kernel-support" // the "tls" ULP does not attach (no CONFIG_TLS / module)
	ReasonVersion         Reason = "version"           // negotiated TLS version is not 1.2 or 1.3
	ReasonCipher          Reason = "cipher"            // suite not AES-GCM/ChaCha20-Poly1305, or the kernel refused it in Probe
	ReasonBufferedBytes   Reason = "buffered-bytes"    // bytes past the handshake are buffered in userspace
	ReasonNotTCP          Reason = "not-tcp"           // no kernel TCP socket under the conn
	ReasonKeyCapture      Reason = "key-capture"       // traffic secrets or ServerHello random not captured
	ReasonSetsockoptULP   Reason = "setsockopt-ulp"    // TCP_ULP failed on this socket
	ReasonSetsockoptTX    Reason = "setsockopt-tx"     // TLS_TX failed (nothing installed: fallback)
	ReasonSetsockoptRX    Reason = "setsockopt-rx"     // TLS_RX (or an RX/TX option) failed after TX: connection closed
	ReasonHandshakeFailed Reason = "handshake-failed"  // the TLS handshake itself failed
)

// Reasons lists every Reason, for metrics pre-registration.
var Reasons = []Reason{ReasonNone, ReasonRXDisabled, ReasonDisabled, ReasonNoKernelSupport, ReasonVersion, ReasonCipher,
	ReasonBufferedBytes, ReasonNotTCP, ReasonKeyCapture, ReasonSetsockoptULP, ReasonSetsockoptTX,
	ReasonSetsockoptRX, ReasonHandshakeFailed}

// Offload is what happened to a connection after its handshake. TX and RX
// come from the kernel's sock_diag answer (INET_DIAG_ULP_INFO); when that
// cannot be read (no inet_diag/tcp_diag module, or no CAP_NET_ADMIN) an
// installed direction is reported as ModeSW, the mode every kernel starts
// in and falls back to when a device refuses the connection.
type Offload struct {
	TX, RX      Mode
	Reason      Reason
	Version     uint16
	CipherSuite uint16
	// RXNoPad: TLS_RX_EXPECT_NO_PAD is in effect, as the kernel reports it
	// (sock_diag; false where the kernel withholds the details).
	RXNoPad bool
}

// OffloadError is returned by the handshake when Options.RequireOffload is
// set and the connection cannot be offloaded, and by the connection when a
// failure after TX was installed closed it.
type OffloadError struct {
	Reason Reason
	Err    error
}

func (e *OffloadError) Error() string {
	if e.Err == nil {
		return "ktls: not offloaded: " + string(e.Reason)
	}
	return fmt.Sprintf("ktls: not offloaded: %s: %v", e.Reason, e.Err)
}

func (e *OffloadError) Unwrap() error { return e.Err }

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
)

// Event is passed to Options.Observer.
type Event struct {
	Kind    EventKind
	Offload Offload
	Remote  net.Addr
	Err     error
}

// StatsSnapshot is a copy of the process-wide counters.
type StatsSnapshot struct {
	TX, RX           map[Mode]uint64   // connections with that direction in each mode
	Outcomes         map[Reason]uint64 // handshakes by Reason (ReasonNone = fully offloaded)
	ControlRecords   map[string]uint64 // received control records by type ("alert", "handshake", ...)
	KeyUpdates       uint64            // KeyUpdates applied
	RateLimitedClose uint64            // connections closed for exceeding KeyUpdateLimit
	ClosedAfterTX    uint64            // connections closed because a step after TLS_TX failed
}

type counters struct {
	mu       sync.Mutex
	tx, rx   map[Mode]uint64
	outcomes map[Reason]uint64
	control  map[string]uint64

	keyUpdates, rateLimited, closedAfterTX atomic.Uint64
}

var stats = counters{tx: map[Mode]uint64{}, rx: map[Mode]uint64{}, outcomes: map[Reason]uint64{}, control: map[string]uint64{}}

// Stats returns the process-wide counters.
func Stats() StatsSnapshot {
	stats.mu.Lock()
	defer stats.mu.Unlock()
	s := StatsSnapshot{
		TX: map[Mode]uint64{}, RX: map[Mode]uint64{}, Outcomes: map[Reason]uint64{}, ControlRecords: map[string]uint64{},
		KeyUpdates: stats.keyUpdates.Load(), RateLimitedClose: stats.rateLimited.Load(), ClosedAfterTX: stats.closedAfterTX.Load(),
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

// tokenBucket enforces a Rate. Not safe for concurrent use: the read lock
// serialises it.
type tokenBucket struct {
	rate   Rate
	tokens float64
	last   time.Time
}

func newTokenBucket(r Rate) tokenBucket {
	if r.PerSecond <= 0 || r.Burst <= 0 {
		r = DefaultKeyUpdateLimit
	}
	return tokenBucket{rate: r, tokens: float64(r.Burst)}
}

// allow takes one token at time now.
func (b *tokenBucket) allow(now time.Time) bool {
	if !b.last.IsZero() {
		b.tokens = min(float64(b.rate.Burst), b.tokens+now.Sub(b.last).Seconds()*b.rate.PerSecond)
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

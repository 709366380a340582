package ktls

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
	// RequireOffload forbids the userspace fallback: a session that cannot
	// be offloaded is refused after its handshake (a reset, as the session
	// is in userspace TLS; EventRefused), and the handshake fails with an
	// *OffloadError naming the reason.
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
	// RecordLimit is how many records one traffic key may protect, in
	// either direction, before the connection renews it or fails
	// (wear.go). Zero value: DefaultRecordLimit; at most MaxRecordLimit.
	RecordLimit uint64
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

package ktls

// Reason says why a connection is not (fully) offloaded. The set is fixed.
// When several apply, the first in this order is reported: disabled,
// version, cipher, buffered-bytes, not-tcp, key-capture (the connection's
// own), then no-kernel-support, cipher (refused by this kernel),
// setsockopt-ulp, setsockopt-tx, setsockopt-rx (the kernel's answers).
type Reason string

// The complete set of reasons, in the order Reasons returns them.
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

var allReasons = []Reason{ReasonNone, ReasonRXDisabled, ReasonDisabled, ReasonNoKernelSupport, ReasonVersion, ReasonCipher,
	ReasonBufferedBytes, ReasonNotTCP, ReasonKeyCapture, ReasonSetsockoptULP, ReasonSetsockoptTX,
	ReasonSetsockoptRX, ReasonHandshakeFailed}

// Reasons returns every Reason, so that metrics can pre-register one series
// per reason.
func Reasons() []Reason {
	return append([]Reason(nil), allReasons...)
}

package preamble

import (
	"errors"
	"fmt"
)

// Reason is the stable, machine-readable cause of a rejection. The strings
// are part of the public contract: logs, metrics labels and alerting rules
// depend on them, so they never change meaning once released.
type Reason string

// The complete set of rejection reasons, in the order Reasons returns them.
const (
	ReasonReadFailed               Reason = "read-failed"                // the transport failed before a whole frame arrived
	ReasonTimeout                  Reason = "timeout"                    // the caller's read deadline expired before a whole frame arrived
	ReasonBadMagic                 Reason = "bad-magic"                  // the first four bytes are not "KTLP": not a preamble at all
	ReasonBadVersion               Reason = "bad-version"                // a version this verifier does not speak
	ReasonOversized                Reason = "oversized"                  // the declared length exceeds the configured cap
	ReasonTruncated                Reason = "truncated"                  // the stream or a field ended early
	ReasonTrailingBytes            Reason = "trailing-bytes"             // bytes between the last field and the signature
	ReasonMalformed                Reason = "malformed"                  // a structural rule broken (reserved byte, length out of range, timestamps inverted)
	ReasonBadKeyID                 Reason = "bad-key-id"                 // key ID empty, too long or outside the charset
	ReasonBadSandboxID             Reason = "bad-sandbox-id"             // sandbox ID empty, too long or outside the charset
	ReasonBadTarget                Reason = "bad-target"                 // address family, address or port not allowed
	ReasonBadExtension             Reason = "bad-extension"              // extension area does not parse or types are not strictly ascending
	ReasonUnknownCriticalExtension Reason = "unknown-critical-extension" // a critical extension this verifier does not understand
	ReasonUnknownKey               Reason = "unknown-key"                // no key with this ID in the keyring
	ReasonBadSignature             Reason = "bad-signature"              // the Ed25519 signature does not verify
	ReasonNotYetValid              Reason = "not-yet-valid"              // issued-at is in the future beyond the allowed skew
	ReasonExpired                  Reason = "expired"                    // expires-at is in the past beyond the allowed skew
	ReasonTTLTooLong               Reason = "ttl-too-long"               // expires-at minus issued-at exceeds the configured maximum
	ReasonBindingMismatch          Reason = "binding-mismatch"           // the signed channel binding differs from this connection's (or the connection has none)
	ReasonBindingRequired          Reason = "binding-required"           // the verifier requires a channel binding and the frame has none
	ReasonReplayedNonce            Reason = "replayed-nonce"             // the nonce was accepted less than MaxTTL + 2*MaxSkew ago, whatever times the frame carries
	ReasonReplayCacheFull          Reason = "replay-cache-full"          // the replay cache is at capacity: fail closed instead of forgetting
)

var allReasons = []Reason{
	ReasonReadFailed, ReasonTimeout, ReasonBadMagic, ReasonBadVersion, ReasonOversized,
	ReasonTruncated, ReasonTrailingBytes, ReasonMalformed, ReasonBadKeyID, ReasonBadSandboxID,
	ReasonBadTarget, ReasonBadExtension, ReasonUnknownCriticalExtension, ReasonUnknownKey,
	ReasonBadSignature, ReasonNotYetValid, ReasonExpired, ReasonTTLTooLong, ReasonBindingMismatch,
	ReasonBindingRequired, ReasonReplayedNonce, ReasonReplayCacheFull,
}

// Reasons returns every rejection reason this package can report, so that
// metrics can pre-register one series per reason.
func Reasons() []Reason {
	return append([]Reason(nil), allReasons...)
}

// Error is a rejected preamble: a stable Reason plus a human-readable detail.
type Error struct {
	Reason Reason
	Detail string
	Err    error // underlying I/O error, if any
}

func (e *Error) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("preamble rejected (%s): %s: %v", e.Reason, e.Detail, e.Err)
	}
	return fmt.Sprintf("preamble rejected (%s): %s", e.Reason, e.Detail)
}

func (e *Error) Unwrap() error { return e.Err }

// ReasonOther is what ReasonOf says of an error that is not a rejection: a
// tunnel that failed for a reason no package names (a bug, or an error a
// future version classifies). It is not a Reason: nothing rejects with it.
const ReasonOther = "other"

// ReasonOf returns the stable reason string of a rejection anywhere in err's
// chain, "" for nil and ReasonOther for an error that is not a rejection.
func ReasonOf(err error) string {
	if err == nil {
		return ""
	}
	var pe *Error
	if errors.As(err, &pe) {
		return string(pe.Reason)
	}
	return ReasonOther
}

// refuse returns the *Error that refuses a frame for r, with its detail.
func refuse(r Reason, format string, args ...any) *Error {
	return &Error{Reason: r, Detail: fmt.Sprintf(format, args...)}
}

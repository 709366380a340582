package gateway

import (
	"crypto/tls"
	"errors"
	"io"
	"net"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

// End is how a tunnel ended, read from the error its forwarder connection
// gave.
type End string

const (
	// EndClosed: close_notify (or no error): the tunnel ran to its end.
	EndClosed End = "closed"
	// EndRefused: the forwarder's access_denied: nothing reached the
	// sandbox.
	EndRefused End = "refused"
	// EndFailed: anything else after the tunnel opened (internal_error, a
	// reset, a timeout): bytes may have reached the sandbox.
	EndFailed End = "failed"
)

// alertAccessDenied is the TLS alert description access_denied (RFC 8446).
const alertAccessDenied = 49

// EndOf classifies err, returned by a read or write on a tunnel (or by
// anything that wraps one, such as an HTTP transport), as its End.
func EndOf(err error) End {
	switch {
	case err == nil, errors.Is(err, io.EOF):
		return EndClosed
	case Refused(err):
		return EndRefused
	}
	return EndFailed
}

// Refused reports whether err is a forwarder's refusal: the fatal alert
// access_denied, as a kernel-TLS connection (ktls.AlertError) or crypto/tls
// (a "remote error") reports it.
func Refused(err error) bool {
	var alert ktls.AlertError
	if errors.As(err, &alert) {
		return alert == alertAccessDenied
	}
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "remote error" && op.Err != nil &&
		op.Err.Error() == tls.AlertError(alertAccessDenied).Error()
}

package gateway

import (
	"errors"
	"io"

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
	// EndMoved: not an end; the tunnel moved to another process
	// (Dialer.MoveTunnels), whose AdoptedTunnel carries it on and reports
	// how it ends.
	EndMoved End = "moved"
	// EndDrained: the process was exiting and the drain's grace period
	// ended while the tunnel ran (Dialer.Drain): it was ended as a
	// failure, and bytes may have reached the sandbox.
	EndDrained End = "drained"
)

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

// Refused reports whether err, from a tunnel, is the forwarder's refusal:
// the fatal alert ktls.AlertAccessDenied, which a forwarder sends
// (ktls.Conn.Refuse) in place of any byte when it rejects a preamble or
// its target, cannot dial the target, or drains. It matches the alert as a
// kernel-TLS connection (ktls.AlertError) or crypto/tls (a "remote error")
// reports it, wrapped or not. Nothing of a refused tunnel reached the
// sandbox. A forwarder in userspace TLS refuses with a TCP reset, which
// Refused does not match.
func Refused(err error) bool {
	d, ok := remoteAlert(err)
	return ok && d == ktls.AlertAccessDenied
}

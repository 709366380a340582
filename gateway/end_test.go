package gateway

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"testing"

	"github.com/ktlsingress/caddy-ktls/ktls"
)

// TestRefused: only the forwarder's access_denied alert, as crypto/tls
// reports a peer's alert (a *net.OpError "remote error") or as a
// kernel-TLS connection does (ktls.AlertError), wrapped or not, is a
// refusal; the alert a failed tunnel ends with, an orderly end, a reset
// and our own alerts are not. (The kernel suites check it against a real
// forwarder's refusal.)
func TestRefused(t *testing.T) {
	remote := func(a tls.AlertError) error { return &net.OpError{Op: "remote error", Err: a} }
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{remote(ktls.AlertAccessDenied), true},
		{fmt.Errorf("reading the tunnel: %w", remote(ktls.AlertAccessDenied)), true},
		{ktls.AlertError(ktls.AlertAccessDenied), true},
		{&net.OpError{Op: "read", Err: ktls.AlertError(ktls.AlertAccessDenied)}, true},
		{remote(80), false},          // internal_error: a tunnel that failed
		{ktls.AlertError(80), false}, // the same on kernel TLS
		{remote(48), false},          // unknown_ca: a refused certificate, not a refused tunnel
		{&net.OpError{Op: "local error", Err: tls.AlertError(ktls.AlertAccessDenied)}, false}, // our own alert
		{errors.New("remote error: tls: access denied"), false},                               // a string is not the alert
		{io.EOF, false},
		{&net.OpError{Op: "read", Err: os.NewSyscallError("read", errors.New("connection reset by peer"))}, false},
		{nil, false},
	} {
		if got := Refused(tc.err); got != tc.want {
			t.Errorf("Refused(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

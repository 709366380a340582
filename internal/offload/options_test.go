package offload

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"syscall"
	"testing"
)

// TestHandshakeFailureReason: each way a peer can fail a handshake has its
// reason, whatever wraps the error.
func TestHandshakeFailureReason(t *testing.T) {
	op := func(err error) error { return &net.OpError{Op: "read", Net: "tcp", Err: err} }
	for _, tc := range []struct {
		err  error
		want string
	}{
		{tls.RecordHeaderError{Msg: "first record does not look like a TLS handshake"}, "not-tls"},
		{fmt.Errorf("ktls: %w", errors.New("tls: client didn't provide a certificate")), "no-client-certificate"},
		{&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, "untrusted-certificate"},
		{errors.New("client leaf certificate failed validation"), "certificate-not-allowed"},
		{fmt.Errorf("ktls: %w", errors.New("no certificate available for 'nosuch.example'")), "unknown-server-name"},
		{context.DeadlineExceeded, "timeout"},
		{op(os.ErrDeadlineExceeded), "timeout"},
		{io.EOF, "closed"},
		{op(os.NewSyscallError("read", syscall.ECONNRESET)), "closed"},
		{errors.New("tls: no cipher suite supported by both client and server"), "other"},
	} {
		if got := handshakeFailureReason(tc.err); got != tc.want {
			t.Errorf("%v: reason %q, want %q", tc.err, got, tc.want)
		}
		if !slices.Contains(HandshakeFailureReasons, tc.want) {
			t.Errorf("reason %q is not in handshakeFailureReasons (no metric series)", tc.want)
		}
	}
}
